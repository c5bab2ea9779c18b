"""verl's real FSDP engine accepts the Gated DeltaNet hybrids - Qwen3.5 (``qwen3_5_text``,
``qwen3_5_moe_text``) and Qwen3-Next (``qwen3_next``), three GDN layers to one gated attention
layer - with ``prefix_grouper: {mode: arbitrary_prefix}``, and its step equals verl's stock step
on the same weights: old log-probs, entropy, ``ppo_loss`` and every gradient, on a tree batch
(a branch inside a provider's tail, a duplicate, a strict prefix). Each family the installed
transformers has (verl 0.9.1 / transformers 5.10: all three; verl 0.8.0 / transformers 4.57:
``qwen3_next``); one spawned rank.

The reference is verl's stock step with ``use_remove_padding: false`` (one padded row per
sample). verl's packed row (``use_remove_padding: true``, what the sharing engine replaces)
is no reference for these models: verl packs a micro-batch into one row and hands the text
model no sequence boundaries (``cu_seqlens`` go only to its multimodal ``qwen3_5`` patch), so
transformers' GDN layers run the packed samples as one sequence and each sample after the
first starts from its predecessor's state (pinned below). On CPU, transformers' torch kernels
run the plain step (no fla); :func:`prefix_sharing.fsdp_compat.plain_kernels.plain_gdn_kernel`
makes its float64 run's recurrence float64 too.

Precision: the fp32 rule (1e-5) cannot hold for the recurrence's decay parameters - the fp32
plain step's own ``A_log`` / ``dt_bias`` gradients are ~2e-4 from float64 - so the exactness
check runs verl in float64 (``_fsdp_engine.verl_float64``): everything within 1e-5 (the runs
agree to ~1e-7: transformers' norms round to fp32). In fp32, the project's verdict: the shared
step no further from the float64 stock step than 2x (3x for gradients) the fp32 stock step is.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

import torch  # noqa: E402

from prefix_sharing.equivalence import compare_pairs, within_tolerance  # noqa: E402
from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import PRESET, run, save_model  # noqa: E402

HYBRID = dataclasses.replace(PRESET, num_layers=4, full_attention_every=4)
GDN_LAYERS = 3
SHARING = {"off": None, "arbitrary_prefix": MODES["arbitrary_prefix"]}
_CONFIGS = {"qwen3_5_text": "Qwen3_5TextConfig", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
            "qwen3_next": "Qwen3NextConfig"}


def _installed_families() -> list[str]:
    import transformers

    return [family for family, config in _CONFIGS.items() if hasattr(transformers, config)]


FAMILIES = _installed_families()
if not FAMILIES:
    pytest.skip("this transformers has none of Qwen3.5 / Qwen3-Next", allow_module_level=True)
FIRST = FAMILIES[0]  # the fp32 verdict and the packed-row check run on one family


def one_rank(rank: int, paths: dict[str, str]) -> dict:
    """Per family: the float64 steps; for the first family also the fp32 steps and verl's
    stock packed step (one spawned rank)."""
    float64 = functools.partial(run, precision="fp64", padded_off=True)
    results = {family: float64(rank, path, ["tree"], SHARING) for family, path in paths.items()}
    results["fp32"] = run(rank, paths[FIRST], ["tree"], SHARING, padded_off=True)
    results["packed"] = run(rank, paths[FIRST], ["tree"], {"off": None})
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    paths = {f: save_model(str(tmp_path_factory.mktemp(f)), f, preset=HYBRID) for f in FAMILIES}
    return run_gloo(one_rank, 1, paths, timeout=900)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_shared_step_equals_verls_stock_step(runs, family):
    on, off = runs[family]["tree", "arbitrary_prefix"], runs[family]["tree", "off"]
    assert on["engine"] == "PrefixSharingFSDPEngine"
    assert on["attention_calls"] > 0 and off["attention_calls"] == 0
    assert on["infer"]["model_output"]["log_probs"][0].dtype == torch.float64
    same_outputs(on, off, f"{family} float64")


def test_verl_built_the_hybrid_and_its_attention_layer_ran_the_sharing_attention(runs):
    on = runs[FIRST]["tree", "arbitrary_prefix"]
    micro_batches = len(on["train"]["loss"])
    # per micro-batch: the inference forward, the training forward, its checkpoint replay;
    # one attention layer in four
    assert on["attention_calls"] == 3 * (HYBRID.num_layers - GDN_LAYERS) * micro_batches
    assert any(".linear_attn.A_log" in name for name in on["grads"])


def test_float32_verdict_against_the_float64_stock_step(runs):
    reference = runs[FIRST]["tree", "off"]  # float64
    on, off = runs["fp32"]["tree", "arbitrary_prefix"], runs["fp32"]["tree", "off"]
    shared, plain = (compare_pairs(_pairs(r, reference)) for r in (on, off))
    verdict = within_tolerance(shared, plain, torch.float32)
    assert all(verdict.values()), (shared.max_rel_diff, plain.max_rel_diff)


def test_verls_packed_row_carries_gdn_state_across_samples(runs):
    """Why the reference is the padded step: in verl's packed row the first sample of each
    micro-batch is right, the next ones start from their predecessor's GDN state."""
    packed = runs["packed"]["tree", "off"]["infer"]["model_output"]["log_probs"]
    padded = runs["fp32"]["tree", "off"]["infer"]["model_output"]["log_probs"]
    per_sample = [float((a[:-1] - b[:-1]).abs().max()) for a, b in zip(packed, padded,
                                                                         strict=True)]
    assert max(per_sample[0::2]) < 1e-5, per_sample  # micro-batches of 2
    assert min(per_sample[1::2]) > 1e-3, per_sample


def _pairs(run_: dict, reference: dict) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``(candidate, reference)`` tensors per quantity, as verl returns them, from each sample's
    first read position (the sharing head scores verl's read window only; each sample's last
    log-prob predicts nothing and is left out)."""
    outputs, ref = run_["infer"]["model_output"], reference["infer"]["model_output"]
    starts = run_["read_from"]
    return {
        "log_probs": [(a[s:-1], b[s:-1]) for a, b, s in zip(
            outputs["log_probs"], ref["log_probs"], starts, strict=True)],
        "entropy": [(a[s:], b[s:]) for a, b, s in zip(outputs["entropy"], ref["entropy"], starts,
                                                       strict=True)],
        # summed over the step: fixed micro-batches may hold the samples in another order,
        # which moves loss between micro-batches but not the sum (_compare.same_outputs)
        "loss": [(torch.tensor(sum(run_["train"]["loss"])),
                  torch.tensor(sum(reference["train"]["loss"])))],
        "grads": [(run_["grads"][name], grad) for name, grad in reference["grads"].items()],
    }
