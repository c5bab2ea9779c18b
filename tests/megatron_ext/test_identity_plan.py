"""A micro-batch with nothing to share runs megatron's stock THD step, bit for bit, and no more.

When the plan is the identity (``plan.has_sharing`` is False, known on the host when the plan
is built), the core attention gathers no K/V and calls the plain THD kernel on the plan's
segments, and RoPE reads one per-token table gathered once per micro-batch. Megatron's stock
THD step (plain ``PackedSeqParams``, its own THD RoPE) builds its packed rotary table in every
layer instead, reading the segment lengths back to the host each time.

Checked on the same model and weights, forward and backward, for the tiny model and a variant
with a sliding window and Q/K norms:
- logits, log-probs, entropy and every parameter gradient are bitwise equal to the stock step's;
- the aten operators the identity step runs are the stock step's, less its per-layer RoPE
  packing, plus exactly one ``index_select`` (the rotary table): no gather, no scatter-add,
  no host read per layer.

A step-wise chain whose earlier steps are strict prefixes of its last one shares (the log-probs
read the shared rows) but no query segment reads a prefix (``plan.has_kv_gather`` is False):
its step runs no K/V gather either, nothing beyond the stock step's operators but that one
rotary ``index_select`` (its exactness is the equivalence tests' ``steprl`` case).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prefix_sharing.workloads import make_workload

from ._distributed import PRESET, run_distributed, tiny_gpt
from ._equivalence import SHARE_EVERY_PREFIX, WORKLOADS

MODELS = {"dense": {}, "window_qk_norm": dict(window_size=(4, 0), qk_layernorm=True)}


class _CountOps(TorchDispatchMode):
    """Counts the aten operators run (forward and backward), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step(model: torch.nn.Module, sequences: list[torch.Tensor], layout: str) -> dict:
    """One forward + backward (log-prob and entropy loss): its outputs, gradients and ops."""
    from prefix_sharing.engines.megatron import stock_thd_batch, stock_thd_token_stats
    from prefix_sharing.megatron_ext import prepare_micro_batch, token_stats

    model.zero_grad(set_to_none=True)
    with _CountOps() as counter:
        if layout == "stock":
            inputs, stats_batch = stock_thd_batch(sequences, backend=SHARE_EVERY_PREFIX.backend)
            logits = model(inputs.input_ids, inputs.position_ids, None,
                           packed_seq_params=inputs.packed_seq_params)
            stats = stock_thd_token_stats(logits, inputs, stats_batch)
        else:
            batch = prepare_micro_batch(sequences, SHARE_EVERY_PREFIX)
            assert not batch.plan.has_kv_gather, "the workload was meant to read no prefix K/V"
            assert batch.plan.has_sharing == (layout == "chain")
            logits = model(batch.input_ids, batch.position_ids, None,
                           packed_seq_params=batch.packed_seq_params)
            stats = token_stats(logits, batch)
        (stats.log_probs * 1.5 - stats.entropy * 0.25).sum().backward()
    return {
        "ops": counter.ops,
        "logits": logits.detach(),
        "log_probs": stats.log_probs.detach(),
        "entropy": stats.entropy.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


def _identity_vs_stock_job(rank: int) -> dict:
    sequences = make_workload("none", vocab_size=PRESET.vocab_size, seed=0,
                              **WORKLOADS["none"]).sequences
    report = {}
    for name, overrides in MODELS.items():
        model = tiny_gpt(**overrides)
        stock, identity = _step(model, sequences, "stock"), _step(model, sequences, "identity")
        report[name] = {
            "unequal": [q for q in ("logits", "log_probs", "entropy")
                        if not torch.equal(stock[q], identity[q])]
            + [f"grad {n}" for n, g in stock["grads"].items()
               if not torch.equal(g, identity["grads"][n])],
            "identity_only_ops": dict(identity["ops"] - stock["ops"]),
            "stock_only_ops": dict(stock["ops"] - identity["ops"]),
        }
    chain = make_workload("steprl", vocab_size=PRESET.vocab_size, seed=0,
                          **WORKLOADS["steprl"]).sequences
    model = tiny_gpt()
    stock, shared = _step(model, chain, "stock"), _step(model, chain, "chain")
    report["chain_only_ops"] = dict(shared["ops"] - stock["ops"])
    return report


@pytest.fixture(scope="module")
def report() -> dict:
    return run_distributed(_identity_vs_stock_job, 1, timeout=300)[0]


@pytest.mark.parametrize("model", list(MODELS))
def test_identity_plan_equals_the_stock_thd_step_bitwise(report, model):
    assert report[model]["unequal"] == []


@pytest.mark.parametrize("model", list(MODELS))
def test_identity_plan_runs_only_one_rotary_gather_beyond_the_stock_step(report, model):
    assert report[model]["identity_only_ops"] == {"index_select": 1}
    # what it saves: megatron's per-layer THD RoPE packing, which reads lengths to the host
    assert report[model]["stock_only_ops"].get("_local_scalar_dense", 0) >= PRESET.num_layers


def test_a_chain_of_strict_prefixes_gathers_no_keys(report):
    assert report["chain_only_ops"] == {"index_select": 1}
