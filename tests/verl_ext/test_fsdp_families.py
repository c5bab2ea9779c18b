"""verl's FSDP engine with sharing on gives verl's stock step on each text family verl's FSDP
recipes train (``verl-0.9`` examples: Qwen3, Qwen3-MoE, gpt-oss, Qwen3-Next, Mistral, Gemma,
Seed-OSS, DeepSeek-Coder's Llama), MoE routers included.

Each family: a tiny seeded checkpoint made offline from its transformers config class (2
layers, hidden 64; the MoE ones 4 experts, 2 per token; Qwen3-Next one Gated DeltaNet and one
attention layer), loaded by verl's own ``initialize()`` (``_fsdp_engine``), one spawned rank;
old log-probs, entropy, ``ppo_loss`` and every gradient (the routers' included) within 1e-5,
on a tree batch (a branch inside a provider's tail, a duplicate, a strict prefix). fp32, except
Qwen3-Next in float64 (the fp32 rule cannot hold for a Gated DeltaNet's decay gradients even
between two plain runs: ``test_fsdp_hybrid``). The reference is verl's stock packed step,
except for gpt-oss - its transformers masks ignore the packed row's restarting positions off
flash-attention (``test_fsdp_windowed``) - and Qwen3-Next - verl's packed row carries GDN state
across samples (``test_fsdp_hybrid``): their reference is verl's padded step.

The router's auxiliary loss as verl takes it: verl 0.9.1's FSDP engine sets no
``output_router_logits`` (the checkpoint's config decides), passes no labels and its losses
never read the output's ``aux_loss``, so the term adds nothing to verl's gradients, with or
without sharing. The MoE checkpoints here turn ``output_router_logits`` on (coefficient 0.5) so
the model computes it: the shared step's statistic, each flat row weighted by the tokens it
stands for (:func:`prefix_sharing.fsdp_compat.router_aux_loss`), equals the stock step's
``aux_loss`` per micro-batch; the flat rows unweighted (the model's own ``aux_loss`` under
sharing) do not - the control. Qwen2.5 runs in ``test_fsdp_engine``, the vision-language
families (Qwen3.5-MoE and Qwen3-VL-MoE among them) in ``test_fsdp_vlm``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._compare import MODES, RTOL, same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import PRESET, engine_class, run, save_model  # noqa: E402

SHARING = {"off": None, "arbitrary_prefix": MODES["arbitrary_prefix"]}
MOE = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
TINY = dataclasses.replace(PRESET, full_attention_every=2)  # Qwen3-Next: a GDN, an attention layer
# recipe family -> (transformers family, checkpoint config overrides, reference layout, precision)
FAMILIES = {
    "qwen3": ("qwen3", {}, "packed", "fp32"),
    "qwen3-moe": ("qwen3_moe", MOE, "packed", "fp32"),
    "gpt-oss": ("gpt_oss", MOE, "padded", "fp32"),
    "qwen3-next": ("qwen3_next", MOE, "padded", "fp64"),
    "mistral": ("mistral", {}, "packed", "fp32"),
    "gemma": ("gemma", {}, "packed", "fp32"),
    "seed-oss": ("seed_oss", {}, "packed", "fp32"),
    "deepseek-coder": ("llama", {}, "packed", "fp32"),
}


@contextlib.contextmanager
def router_statistics(records: list):
    """Records, per micro-batch the engine runs (inference and training), the model output's
    ``aux_loss`` and, with sharing on, the plan's weighted statistic of its router logits."""
    import torch

    from prefix_sharing.fsdp_compat import router_aux_loss

    cls = engine_class()
    stock = cls.prepare_model_outputs

    def recording(self, output, output_args, micro_batch, logits_processor_func):
        aux = getattr(output, "aux_loss", None)
        if aux is not None:
            config = self.module.config
            entry = {"aux_loss": aux.detach().clone()}
            if self.prefix_sharing.enabled:
                experts = getattr(config, "num_experts", None) or config.num_local_experts
                with torch.no_grad():
                    entry["weighted"] = router_aux_loss(
                        output.router_logits, output_args["plan"], experts,
                        config.num_experts_per_tok)
            records.append(entry)
        return stock(self, output, output_args, micro_batch, logits_processor_func)

    cls.prepare_model_outputs = recording
    try:
        yield records
    finally:
        cls.prepare_model_outputs = stock


def one_rank(rank: int, paths: dict[str, str]) -> dict:
    results = {}
    for name, path in paths.items():
        family, _, reference, precision = FAMILIES[name]
        records = []
        with router_statistics(records):
            # the whole batch (6 samples) in one micro-batch: the router statistic is taken per micro-batch,
            # and fixed micro-batches of 2 would let the sharing engine reorder the samples
            # (which changes no loss or gradient here, but the micro-batches' statistics)
            results[name] = run(rank, path, ["tree"], SHARING, precision=precision,
                                micro_batch_size=6, padded_off=reference == "padded",
                                attn_implementation="eager" if family == "gpt_oss" else "sdpa")
        half = len(records) // 2  # the stock step's micro-batches, then the shared step's
        results[name]["router"] = {"off": records[:half], "on": records[half:]}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    paths = {}
    for name, (family, overrides, _, _) in FAMILIES.items():
        paths[name] = save_model(str(tmp_path_factory.mktemp(family)), family, preset=TINY,
                                 **overrides)
    return run_gloo(one_rank, 1, paths, timeout=900)[0]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_recipe_family_shared_step_equals_verls_stock_step(runs, name):
    on, off = runs[name]["tree", "arbitrary_prefix"], runs[name]["tree", "off"]
    assert on["engine"] == "PrefixSharingFSDPEngine"
    assert on["attention_calls"] > 0 and off["attention_calls"] == 0
    metrics = on["train"]["metrics"]
    assert metrics["prefix_sharing/tokens_computed"][0] < metrics["prefix_sharing/tokens_total"][0]
    same_outputs(on, off, name)
    if FAMILIES[name][1] is MOE:  # the routers' gradients are among those compared
        assert any("router" in key or ".gate." in key for key in off["grads"]), list(off["grads"])


@pytest.mark.parametrize("name", [n for n, (_, extra, *_) in FAMILIES.items() if extra is MOE])
def test_router_statistics_weighted_by_multiplicity_equal_the_stock_steps(runs, name):
    router = runs[name]["router"]
    assert router["off"] and len(router["off"]) == len(router["on"]), router
    for plain, shared in zip(router["off"], router["on"], strict=True):
        reference = float(plain["aux_loss"])
        assert abs(float(shared["weighted"]) - reference) <= RTOL * abs(reference)
    # the control: the flat rows unweighted count each shared prefix token once (seen: 9e-4
    # relative and more; near-balanced tiny routers keep it small)
    assert any(abs(float(shared["aux_loss"]) - float(plain["aux_loss"]))
               > 10 * RTOL * abs(float(plain["aux_loss"]))
               for plain, shared in zip(router["off"], router["on"], strict=True))
