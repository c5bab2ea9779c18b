"""How the verl engine tests judge a run with sharing on against the same run with it off.

A run is what ``_engine.run`` (or the FSDP driver) returns per (workload, mode): ``infer``
(``infer_batch``'s log-probs and entropy, one tensor per sample), ``train``
(``forward_backward_batch``'s per-micro-batch losses and metrics) and ``grads`` (every
parameter's gradient, by name). fp32 throughout: within :data:`RTOL` relative to the plain
run's largest magnitude.
"""

from __future__ import annotations

import torch

RTOL = 1e-5
MODES = {
    "off": None,
    "arbitrary_prefix": {"mode": "arbitrary_prefix", "min_prefix_len": 1},
    "prompt_only": {"mode": "prompt_only", "min_prefix_len": 1},
}


def close(shared: torch.Tensor, plain: torch.Tensor, what: str) -> None:
    """``max|shared - plain| <= RTOL * max|plain|`` (with a floor of 1e-6 on the scale)."""
    assert shared.shape == plain.shape, f"{what}: {tuple(shared.shape)} vs {tuple(plain.shape)}"
    assert plain.numel(), f"{what}: empty comparison"
    err = (shared - plain).abs().max() / plain.abs().max().clamp(min=1e-6)
    assert err <= RTOL, f"{what}: relative error {float(err):.2e}"


def same_outputs(shared: dict, plain: dict, where: str, *, per_micro_batch: bool = True) -> None:
    """Every gradient; then, where the rank returns outputs (an inner pipeline stage returns
    none), log-probs (all but each sample's last position, which predicts nothing: verl fills
    it from a wrapped-around label, and downstream reads stop before it; from each sample's
    ``shared["read_from"]`` position on where the shared run scores only verl's read window),
    entropy (where the runs return it), and the step's loss, summed over its micro-batches
    (verl normalises each micro-batch's share by the step's global figures; the sharing engine
    may put fixed micro-batches' samples in another order, which moves loss between
    micro-batches but not the sum): with the same number of micro-batches, or any when the two
    runs split the batch differently (``per_micro_batch=False``)."""
    assert shared["grads"].keys() == plain["grads"].keys(), f"{where}: parameter names differ"
    assert plain["grads"], f"{where}: no gradients to compare"
    for name, grad in plain["grads"].items():
        close(shared["grads"][name], grad, f"{where} grad {name}")
    assert bool(shared["infer"]) == bool(plain["infer"]), f"{where}: only one run returned outputs"
    if not plain["infer"]:
        return
    for key in ("log_probs", "entropy"):
        if key not in plain["infer"]["model_output"]:
            assert key not in shared["infer"]["model_output"], f"{where}: only shared has {key}"
            continue
        pairs = zip(shared["infer"]["model_output"][key], plain["infer"]["model_output"][key],
                    strict=True)
        read_from = shared.get("read_from")
        for i, (s, p) in enumerate(pairs):
            assert s.shape == p.shape, f"{where} {key}[{i}] shape"
            start = 0 if read_from is None else read_from[i]
            upto = -1 if key == "log_probs" else None
            close(s[start:upto], p[start:upto], f"{where} {key}[{i}]")
    losses_s, losses_p = shared["train"]["loss"], plain["train"]["loss"]
    if per_micro_batch:
        assert len(losses_s) == len(losses_p), (
            f"{where}: {len(losses_s)} vs {len(losses_p)} micro-batches")
    assert losses_p, f"{where}: no losses to compare"
    losses_s, losses_p = [sum(losses_s)], [sum(losses_p)]
    for s, p in zip(losses_s, losses_p, strict=True):
        assert abs(s - p) <= RTOL * max(abs(p), 1e-6), f"{where} loss {s} vs {p}"
