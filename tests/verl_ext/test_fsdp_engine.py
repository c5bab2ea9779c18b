"""verl's real FSDP engine with ``prefix_grouper`` on gives what it gives with it off
(whichever supported verl is installed: 0.9.1 or 0.8.0, the same seams).

verl loads a tiny seeded Qwen2 from a ``save_pretrained`` checkpoint through its own
``initialize()`` (monkey patches, gradient checkpointing, FSDP2, optimizer); see
``_fsdp_engine``. Compared, fp32 within 1e-5: old log-probs and entropy (``infer_batch``),
verl's ``ppo_loss`` (entropy and KL terms on) and every gradient (``forward_backward_batch``), on
GRPO, step-wise, tree and agent batches, one rank and two FSDP2 ranks (gloo; each rank its own
batch). FSDP1 (``strategy: fsdp``, verl's default) on GRPO and tree batches, one rank and two.
With dynamic batch size, the group-keeping split gives verl's results in fewer micro-batches;
with fixed micro-batches, an order of the samples that keeps groups whole gives verl's results
in verl's order. verl's padded layout (``use_remove_padding: false``) is served against verl's
own padded step. Settings that cannot be exact are refused with one error.
"""

import importlib.util
from functools import partial
from importlib.metadata import version

import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._batch import WORKLOADS  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import refusals, run, save_model  # noqa: E402
from tests.verl_ext._overlays import OVERLAY_MODES, overlay_configs  # noqa: E402

SHARING = {"arbitrary_prefix": MODES["arbitrary_prefix"]}
BUDGET = 110  # the GRPO batch: 138 tokens, 107 computed with sharing
LAYERS = 2  # the tiny preset's decoder layers
SPLIT_METRICS = ("prefix_sharing/num_micro_batches", "prefix_sharing/groups_split")
INTERLEAVED = [0, 3, 1, 4, 2, 5]  # the GRPO batch's two groups of 3, alternating


def one_rank(rank: int, path: str) -> dict:
    """Every workload and mode; the dynamic-bsz step; fixed micro-batches of 3 over
    interleaved groups; the padded layout; the refusals (one spawned rank)."""
    return {
        "equivalence": run(rank, path, list(WORKLOADS), MODES),
        "dynamic": run(rank, path, ["grpo"], {"off": None, **SHARING}, dynamic_bsz=BUDGET),
        "fixed": run(rank, path, ["grpo"], MODES, micro_batch_size=3, batch_order=INTERLEAVED),
        "padded": run(rank, path, ["grpo", "tree"], {"off": None, **SHARING}, padded=True),
        "refusals": refusals(rank, path),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_model(str(tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="module")
def single(checkpoint):
    return run_gloo(one_rank, 1, checkpoint, timeout=400)[0]


@pytest.fixture(scope="module")
def v1_layout(checkpoint):
    """GRPO as verl 0.9's v1 trainer hands it over (TransferQueue's per-sample fields)."""
    if importlib.util.find_spec("transfer_queue") is None:
        pytest.skip("verl 0.9's v1 trainer layout needs TransferQueue (verl's verl-core extra)")
    return run_gloo(partial(run, layout="v1"), 1, checkpoint, ["grpo"],
                    {"off": None, "prompt_only": MODES["prompt_only"]}, timeout=400)[0]


@pytest.fixture(scope="module", params=["fsdp2", "fsdp"])
def two_ranks(request, checkpoint):
    """GRPO and tree, feature off and on, at two ranks of FSDP2 or FSDP1."""
    return run_gloo(partial(run, strategy=request.param), 2, checkpoint, ["grpo", "tree"],
                    {"off": None, **SHARING}, timeout=400)


@pytest.fixture(scope="module")
def fsdp1(checkpoint):
    """GRPO, feature off and on, on one FSDP1 rank (the workloads and modes ``single`` covers
    on FSDP2 run the same forward; ``two_ranks`` adds the tree)."""
    return run_gloo(partial(run, strategy="fsdp"), 1, checkpoint, ["grpo"],
                    {"off": None, **SHARING}, timeout=400)[0]


def test_the_fsdp_patch_set_of_the_installed_release_is_applied():
    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401

    from prefix_sharing.verl_ext import installed
    from prefix_sharing.verl_ext.engine import registered_engine

    release = "verl" + version("verl").replace(".", "")
    assert f"{release}_fsdp" in installed()
    assert all(name.startswith(release) for name in installed())
    assert {registered_engine("language_model", backend, *device).__name__
            for backend in ("fsdp", "fsdp2")
            for device in (("cuda", "nvidia"), ("cuda", "amd"), ("npu", "huawei"))
            } == {"PrefixSharingFSDPEngine"}


@pytest.mark.skipif(version("verl") == "0.8.0", reason="verl 0.8.0's registry has no vendor keys")
def test_the_sharing_engine_is_registered_beside_verls_under_vendor_keys():
    # through EngineRegistry.register's public vendor key, which verl's lookup tries first;
    # verl's own class stays the device's entry
    import verl.workers.engine.fsdp.transformer_impl as impl
    from verl.workers.engine.base import EngineRegistry

    for backend in ("fsdp", "fsdp2"):
        entries = EngineRegistry._engines["language_model"][backend]
        assert entries["cuda"] is entries["npu"] is impl.FSDPEngineWithLMHead
        assert entries["cuda", "nvidia"] is impl.PrefixSharingFSDPEngine


def test_log_probs_entropy_loss_and_gradients_match_the_feature_off_on_one_rank(single):
    runs = single["equivalence"]
    for workload in WORKLOADS:
        for mode in MODES:
            if mode != "off":
                same_outputs(runs[workload, mode], runs[workload, "off"], f"{workload} {mode}")


def test_prompt_only_shares_and_matches_the_feature_off_on_the_v1_trainers_batch(v1_layout):
    # nested prompts, all-ones nested attention_mask, uid a NonTensorStack: what failed in
    # verl 0.9.1's real trainer ("needs the padded attention_mask")
    same_outputs(v1_layout["grpo", "prompt_only"], v1_layout["grpo", "off"], "v1 prompt_only")
    metrics = v1_layout["grpo", "prompt_only"]["train"]["metrics"]
    assert metrics["prefix_sharing/tokens_computed"][0] < metrics["prefix_sharing/tokens_total"][0]
    assert v1_layout["grpo", "prompt_only"]["attention_calls"] > 0


def test_two_fsdp_ranks_match_the_feature_off(two_ranks):
    for rank, runs in enumerate(two_ranks):
        for workload in ("grpo", "tree"):
            same_outputs(runs[workload, "arbitrary_prefix"], runs[workload, "off"],
                         f"rank {rank} {workload}")
            assert runs[workload, "arbitrary_prefix"]["attention_calls"] > 0
    # the data-parallel gradient is whole on every rank: FSDP1's flat shards gathered right
    for name, grad in two_ranks[0]["grpo", "off"]["grads"].items():
        assert torch.equal(two_ranks[1]["grpo", "off"]["grads"][name], grad), name


def test_fsdp1_matches_the_feature_off_on_one_rank(fsdp1):
    on, off = fsdp1["grpo", "arbitrary_prefix"], fsdp1["grpo", "off"]
    same_outputs(on, off, "FSDP1 grpo")
    assert on["engine"] == "PrefixSharingFSDPEngine"
    assert on["attention_calls"] == 3 * LAYERS * len(on["train"]["loss"])
    assert off["attention_calls"] == 0


def test_fsdp1_and_fsdp2_give_verl_the_same_step(fsdp1, single):
    # same weights, same batch, feature off: FSDP1's gradients, by name, are FSDP2's
    same_outputs(fsdp1["grpo", "off"], single["equivalence"]["grpo", "off"], "FSDP1 vs FSDP2")


def test_the_model_verl_built_runs_the_sharing_attention_and_the_plain_one_does_not(single):
    for (workload, mode), result in single["equivalence"].items():
        micro_batches = len(result["train"]["loss"])
        # per micro-batch: the inference forward, the training forward, its checkpoint replay
        expected = 0 if mode == "off" else 3 * LAYERS * micro_batches
        assert result["attention_calls"] == expected, (workload, mode)
        assert result["engine"] == "PrefixSharingFSDPEngine"


def test_sharing_metrics_reach_verls_metrics_dict_as_lists(single):
    # verl's worker all-gathers each metric over DP ranks, then flattens a list (or
    # aggregates its own Metric objects): a bare number fails there
    for workload in WORKLOADS:
        plain = single["equivalence"][workload, "off"]["train"]["metrics"]
        assert not any(key.startswith("prefix_sharing/") for key in plain)
        for mode in ("arbitrary_prefix", "prompt_only"):
            metrics = single["equivalence"][workload, mode]["train"]["metrics"]
            total, computed = (metrics[f"prefix_sharing/tokens_{k}"][0]
                               for k in ("total", "computed"))
            assert computed < total, f"{workload} {mode}: nothing shared"
            assert metrics["prefix_sharing/token_ratio"] == [pytest.approx(total / computed)]
            assert all(key in metrics for key in SPLIT_METRICS)  # fixed micro-batches too
            assert all(isinstance(value, list) for key, value in metrics.items()
                       if key.startswith("prefix_sharing/")), metrics


def test_dynamic_bsz_keeps_groups_together_in_fewer_micro_batches_with_equal_results(single):
    off, on = single["dynamic"]["grpo", "off"], single["dynamic"]["grpo", "arbitrary_prefix"]
    same_outputs(on, off, "dynamic bsz", per_micro_batch=False)  # verl's global token mean
    assert len(off["train"]["loss"]) == 2  # verl: 138 tokens over a budget of 110
    assert len(on["train"]["loss"]) == 1  # 107 computed tokens fit in one
    assert on["train"]["metrics"]["prefix_sharing/num_micro_batches"] == [1.0]
    assert on["train"]["metrics"]["prefix_sharing/groups_split"] == [0.0]


@pytest.mark.parametrize("mode", ["arbitrary_prefix", "prompt_only"])
def test_fixed_micro_batches_keep_interleaved_groups_whole_with_verls_results(single, mode):
    off, on = single["fixed"]["grpo", "off"], single["fixed"]["grpo", mode]
    # per-sample outputs back in the batch's order; the loss is verl's global token mean
    same_outputs(on, off, f"fixed micro-batches {mode}", per_micro_batch=False)
    assert len(on["train"]["loss"]) == len(off["train"]["loss"]) == 2  # 3 samples each
    metrics = on["train"]["metrics"]
    # verl's chunks [a b a][b a b] cut both groups: nothing shared there
    assert metrics["prefix_sharing/groups_split"] == [0.0]
    assert metrics["prefix_sharing/tokens_computed"][0] < metrics["prefix_sharing/tokens_total"][0]


def test_fixed_micro_batches_left_in_order_cut_the_groups_and_share_nothing(single):
    # the control: verl's own chunks of the interleaved batch, as the sharing engine keeps
    # them where the order already keeps the groups (here GRPO's contiguous groups of 3 in
    # micro-batches of 2: cut either way)
    metrics = single["equivalence"]["grpo", "arbitrary_prefix"]["train"]["metrics"]
    assert metrics["prefix_sharing/groups_split"] == [2.0]
    assert metrics["prefix_sharing/num_micro_batches"] == [3.0]


def test_the_padded_layout_is_served_and_matches_verls_padded_step(single):
    for workload in ("grpo", "tree"):
        off, on = single["padded"][workload, "off"], single["padded"][workload, "arbitrary_prefix"]
        same_outputs(on, off, f"padded {workload}")
        assert set(off["input_rows"]) == {2}  # verl's padded rows: one per sample
        assert set(on["input_rows"]) == {1}  # the flat layout, planned by the sharing engine
        assert on["attention_calls"] > 0
        metrics = on["train"]["metrics"]
        assert metrics["prefix_sharing/tokens_computed"][0] < metrics["prefix_sharing/tokens_total"][0]


@pytest.mark.parametrize("setting, message", [
    ("temperatures", "several sampling temperatures in one micro-batch (temperatures"),
    ("sum_pi_squared", "per-sample logits (calculate_sum_pi_squared)"),

])
def test_settings_sharing_cannot_honour_raise_one_clear_error(single, setting, message):
    assert message in single["refusals"].get(setting, "(not refused)")


@pytest.mark.parametrize("overlay, mode", OVERLAY_MODES)
def test_each_overlay_configures_the_fsdp_actor_and_reference_model(overlay, mode):
    _, configs = overlay_configs(overlay, dict(
        _target_="verl.workers.config.FSDPActorConfig", strategy="fsdp2", rollout_n=2,
        ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
        fsdp_config={"_target_": "verl.workers.config.FSDPEngineConfig"},
    ))
    for section, config in configs.items():
        assert config.engine.prefix_sharing.mode == mode, section
