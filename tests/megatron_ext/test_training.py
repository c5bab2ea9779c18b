"""A model built from the ``--spec`` argument trains on a shared batch exactly like the plain one.

Megatron-LM resolves ``--spec <module> <name>`` with megatron-core's ``import_module`` and passes
the object to ``GPTModel``; this test does the same, then runs 20 Adam steps on a GRPO micro-batch
next to megatron's stock local spec on the padded batch (same initial weights), and compares
every step's loss and the final parameters.

Final parameters, per tensor: ``||shared - plain|| / ||plain||``. Each step's gradients agree
to ~1e-7 of their scale, but Adam divides every element by its own running RMS, so an element
whose gradient hovers near zero turns a 1e-7 reordering of fp32 rounding into an update of
either sign, and 20 steps compound it. Two *plain* implementations drift apart the same way:
the same model on the packed layout (this package's THD path, nothing shared) ends up to 4e-6
from the padded stock run; the shared run up to 1.2e-5 (measured). So the shared drift must
stay within 5x the plain-vs-plain drift (floor 1e-6) and below 1e-4 absolutely.
"""

from __future__ import annotations

import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.engines.megatron import forward_backward

from ._distributed import run_distributed, tiny_gpt
from ._equivalence import micro_batches

STEPS = 20
SPEC_ARG = ("prefix_sharing.megatron_ext.megatron_lm_spec", "layer_spec")
SHARING = PrefixSharingConfig()  # the defaults: prefixes of >= 8 tokens


def _train_job(rank: int) -> dict:
    from megatron.core.transformer.spec_utils import import_module

    batch = micro_batches(["grpo"])
    # outside Megatron-LM the --spec object is the default local spec: LayerNorm
    models = {
        "shared": tiny_gpt(layer_spec=import_module(SPEC_ARG), normalization="LayerNorm"),
        "packed": tiny_gpt(layer_spec=import_module(SPEC_ARG), normalization="LayerNorm"),
        "padded": tiny_gpt("padded", normalization="LayerNorm"),
    }
    initial = {n: p.detach().clone() for n, p in models["padded"].named_parameters()}
    losses = {name: [] for name in models}
    digests = set()
    for name, model in models.items():
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(STEPS):
            result = forward_backward(model, batch, name, SHARING)
            losses[name].append(result.outputs[0].loss.item())
            optimizer.step()
            if name == "shared":
                digests.update(result.digests)
    params = {name: {n: p.detach() for n, p in m.named_parameters()} for name, m in models.items()}
    return {"losses": losses, "params": params, "initial": initial, "shared_digests": digests}


def test_spec_argument_model_trains_like_the_plain_model():
    result = run_distributed(_train_job, 1, timeout=600)[0]
    # the shared run computed the plan of this batch (same digest), and that plan shares
    plan = build_plan(micro_batches(["grpo"])[0], SHARING)
    assert result["shared_digests"] == {plan.digest()}
    assert plan.has_sharing and plan.num_tokens_unique < 0.6 * plan.num_tokens_total
    shared, stock = result["losses"]["shared"], result["losses"]["padded"]
    assert len(shared) == STEPS and stock[-1] < stock[0] - 0.1  # it really trained
    for step, (a, b) in enumerate(zip(shared, stock)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs {b}"
    params = result["params"]
    for name, plain in params["padded"].items():
        assert not torch.equal(plain, result["initial"][name]), f"{name} did not move"
        drift = ((params["shared"][name] - plain).norm() / plain.norm()).item()
        plain_drift = ((params["packed"][name] - plain).norm() / plain.norm()).item()
        assert drift <= min(5 * max(plain_drift, 1e-6), 1e-4), (name, drift, plain_drift)
