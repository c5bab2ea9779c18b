"""PEFT LoRA adapters on a model switched by ``enable_prefix_sharing`` give transformers' own
forward of the same PEFT model: logits, log-probs, entropy, loss and every LoRA gradient, with
the adapters active (unmerged), disabled (verl's reference model is the actor with its adapters
disabled) and merged into the weights (what a rollout receives). Whether the switch is called on
the PEFT model or on its base model (verl's order: the HF model is switched, then wrapped).

The adapters are drawn at random (``init_lora_weights=False``: PEFT's default zero ``B`` would
make them a no-op and the LoRA ``A`` gradients zero); a control shows they change the outputs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from prefix_sharing.equivalence import (advantages, compare_runs, max_rel_diff,
                                        within_tolerance)
from prefix_sharing.fsdp_compat import build_model, enable_prefix_sharing
from prefix_sharing.fsdp_compat.runs import plain_run, shared_run
from prefix_sharing.workloads import make_workload

from ._models import EVERY_PREFIX, PRESET

peft = pytest.importorskip("peft", reason="LoRA needs peft (the test extra installs it)")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_pair(family: str, switch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(plain, shared)``: one seeded PEFT model (random adapters on every projection) and its
    copy switched to the sharing attention through ``switch`` (``"peft"``: the PEFT model;
    ``"base"``: the HF model inside it)."""
    torch.manual_seed(1)
    plain = peft.get_peft_model(
        build_model(family, PRESET),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    shared = copy.deepcopy(plain)
    enable_prefix_sharing(shared if switch == "peft" else shared.get_base_model())
    return plain, shared


def runs(plain, shared, workload: str = "tree"):
    w = make_workload(workload, vocab_size=PRESET.vocab_size)
    weights = advantages(w.num_tokens, seed=0)
    return (shared_run(shared, w.sequences, weights, EVERY_PREFIX),
            plain_run(plain, w.sequences, weights))


@pytest.mark.parametrize("switch", ["peft", "base"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_active_adapters_match_the_plain_peft_forward_and_lora_gradients(family, switch):
    plain, shared = lora_pair(family, switch)
    shared_out, plain_out = runs(plain, shared)
    assert plain_out.grads and all("lora_" in name for name in plain_out.grads)
    assert len(plain_out.grads) == 2 * len(TARGETS) * PRESET.num_layers  # every A and B
    comparison = compare_runs(shared_out, plain_out)
    assert all(within_tolerance(comparison).values()), comparison.max_rel_diff


def test_disabled_adapters_match_the_plain_base_forward_and_the_adapters_matter():
    """The reference role: both models with their adapters disabled (no LoRA gradient then:
    the base weights are frozen, so the loss is taken on the log-probs only)."""
    plain, shared = lora_pair("qwen3", "base")
    w = make_workload("grpo", vocab_size=PRESET.vocab_size)
    weights = advantages(w.num_tokens, seed=0)
    for model in (plain, shared):
        model.get_base_model().requires_grad_(True)  # a gradient to compare, on the base
    with plain.disable_adapter(), shared.disable_adapter():
        plain_off = plain_run(plain, w.sequences, weights)
        shared_off = shared_run(shared, w.sequences, weights, EVERY_PREFIX)
    comparison = compare_runs(shared_off, plain_off)
    assert all(within_tolerance(comparison).values()), comparison.max_rel_diff
    assert not any("lora_" in name for name in plain_off.grads)
    # control: the active adapters change every quantity far beyond the tolerance
    active = shared_run(shared, w.sequences, weights, EVERY_PREFIX)
    diffs = {q: max_rel_diff(getattr(active, q), getattr(plain_off, q))
             for q in ("log_probs", "entropy", "loss")}
    assert all(diff > 1e-3 for diff in diffs.values()), diffs


def test_merged_adapters_match_the_plain_merged_model():
    plain, shared = lora_pair("llama", "peft")
    plain, shared = (m.merge_and_unload().requires_grad_(True) for m in (plain, shared))
    comparison = compare_runs(*runs(plain, shared, "agent"))
    assert all(within_tolerance(comparison).values()), comparison.max_rel_diff
