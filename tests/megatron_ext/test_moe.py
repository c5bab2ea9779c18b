"""A mixture-of-experts GPTModel under prefix sharing computes what megatron's stock spec does.

The router's batch statistics - the three load-balancing losses, the z-loss, the expert-bias
token counts and the logged losses - must count every shared token as often as the plain batch
holds it. Each case runs GRPO, tree, agent and unshared micro-batches through megatron's schedule
two ways - shared, and megatron's stock local spec on the padded batch with its
``padding_mask`` - and compares logits, log-probs, entropy, loss and every gradient (router
included, which carries the aux and z-loss terms), the expert-bias counts and the bias update
they give, the global aux loss's counts and the aux-loss tracker. fp32: within 1e-5 relative.

Layouts: one rank; pipeline parallel (PP=2); tensor parallel (TP=2, with
the sequence parallelism megatron's MoE needs there: each rank's statistics are the stock
router's on its slice of the padded batch, and sequence-parallel gradients are summed over the
group as ``finalize_model_grads`` does); and expert parallel: ours at EP=2 equals megatron's
stock spec at EP=1, gradients matched by global expert index.
"""

from __future__ import annotations

import functools

import pytest
import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.engines.megatron import compare, forward_backward, gpt_model
from prefix_sharing.equivalence import FP32_RTOL, max_rel_diff, same_keys
from prefix_sharing.megatron_ext.plain_batch_view import PlainBatchView
from prefix_sharing.presets import PRESETS, sharp
from prefix_sharing.workloads import make_workload

from ._distributed import run_distributed
from ._router_statistics import reset_router_statistics, router_statistics, routers

PRESET = sharp(PRESETS["tiny-moe"])  # the tiny shape, 8 experts of width 64, top-2
SHARE_EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
WORKLOADS = {
    "grpo": dict(num_prompts=2, group_size=3),
    "tree": dict(depth=2, branching=2),
    "agent": dict(num_tasks=1, num_turns=2, branching=2, system_len=6, task_len=(2, 4),
                  turn_len=(2, 4)),
    "none": dict(num_sequences=3),
}
VARIANTS = {
    # the preset: softmax scores, aux + seq aux + global aux losses, z-loss
    "preset": {},
    # DeepSeek-V3 style on top: sigmoid scores and the expert bias
    "expert_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    # full recomputation replays each layer's forward, with its plan
    "recompute_full": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
}
LAYOUTS = {  # name: (world size, tensor parallel, pipeline parallel, variants)
    "one_rank": (1, 1, 1, list(VARIANTS)),
    "pp2": (2, 1, 2, ["preset"]),  # each stage hands its own layers the plan
    # sequence parallel (megatron's MoE needs it under TP): each rank routes its slice of [s, b]
    "tp2": (2, 2, 1, ["preset", "expert_bias"]),
}  # expert parallel 2: against the stock spec at EP=1, further down


# ----------------------------------------------------------------------------- the plain view
EXAMPLE = [[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]]  # SharingPlan's worked example


def test_plain_view_is_the_padded_plain_batch_per_sequence():
    plan = build_plan([torch.tensor(s) for s in EXAMPLE], SHARE_EVERY_PREFIX, pad_to_multiple_of=4)
    view = PlainBatchView.of(plan, per_sequence=True)
    sentinel = plan.num_tokens_flat  # 6 rows + 2 pad rows
    assert view.rows.T.tolist() == [[0, 1, 2, 3, sentinel], [0, 1, 2, 4, 5],
                                    [0, 1, sentinel, sentinel, sentinel]]
    assert torch.equal(view.padding_mask, view.rows == sentinel)
    assert view.readers.tolist() == [0, 3, 6, 9, 10, 13, 0, 0]  # pad rows: position 0


def test_plain_view_without_sequences_is_the_packed_plain_batch():
    plan = build_plan([torch.tensor(s) for s in EXAMPLE], SHARE_EVERY_PREFIX)
    view = PlainBatchView.of(plan, per_sequence=False)
    assert torch.equal(view.rows[:, 0], plan.kv_index) and view.padding_mask is None
    assert view.readers.tolist() == [0, 1, 2, 3, 7, 8]


def test_sequence_parallel_shards_split_the_padded_batch_along_s():
    """As megatron splits the plain ``[s, b]`` batch: ``s`` padded to a multiple of the shards,
    each shard a run of positions; each shard's flat rows read anywhere in the whole batch."""
    plan = build_plan([torch.tensor(s) for s in EXAMPLE], SHARE_EVERY_PREFIX, pad_to_multiple_of=2)
    whole = PlainBatchView.of(plan, per_sequence=True)
    shards = [PlainBatchView.of(plan, per_sequence=True, shards=2, shard=r) for r in range(2)]
    sentinel = plan.num_tokens_flat
    assert torch.equal(torch.cat([v.rows for v in shards]),
                       torch.cat([whole.rows, torch.full((1, 3), sentinel)]))  # s: 5 -> 6
    assert [v.readers.tolist() for v in shards] == [[0, 3, 6], [9, 10, 13]]
    flat = torch.randn(plan.num_tokens_flat, 3)
    plain = torch.cat([v.gather(flat) for v in shards]).reshape(-1, 3)  # what ranks all-gather
    assert torch.equal(torch.cat([v.select(plain) for v in shards]), flat)


@pytest.mark.parametrize("slices, expected", [
    (1, [[1 / 11] * 3] * 5),  # one router: the mean over the 11 real tokens
    # two sequence-parallel slices (s = 5 -> 6): rows 0-2 hold 8 real tokens, rows 3-5 hold 3
    (2, [[1 / 16] * 3] * 3 + [[1 / 6] * 3] * 3),
])
def test_z_loss_weights_are_the_unsplit_routers_shares(slices, expected):
    """Under context parallelism the view is cut in TP x CP = 4 shards; each position keeps
    the weight the TP-slice router at CP=1 gives it, whichever shard routes it."""
    plan = build_plan([torch.tensor(s) for s in EXAMPLE], SHARE_EVERY_PREFIX, pad_to_multiple_of=4)
    shards = [PlainBatchView.of(plan, True, 4, r, z_loss_slices=slices) for r in range(4)]
    weights = torch.cat([v.z_loss_weights for v in shards])  # s: 5 -> 8
    real = torch.cat([~v.padding_mask for v in shards])
    expected = torch.tensor(expected + [[0.0] * 3] * (8 - len(expected)))
    torch.testing.assert_close(weights, torch.where(real, expected, 0.0))
    assert weights.sum().item() == pytest.approx(1.0)


def test_a_flat_layout_that_does_not_split_into_the_shards_is_refused():
    plan = build_plan([torch.tensor(s) for s in EXAMPLE], SHARE_EVERY_PREFIX)  # 6 rows
    with pytest.raises(ValueError, match="6 rows do not split into 4 sequence-parallel shards"):
        PlainBatchView.of(plan, per_sequence=True, shards=4)


@pytest.mark.parametrize("per_sequence", [True, False])
def test_every_flat_row_reads_back_its_own_values(per_sequence):
    plan = build_plan([torch.tensor(s) for s in EXAMPLE], SHARE_EVERY_PREFIX, pad_to_multiple_of=4)
    view = PlainBatchView.of(plan, per_sequence)
    flat = torch.randn(plan.num_tokens_flat, 3)
    plain = view.gather(flat)  # [s, b, 3]
    real = plan.num_tokens_unique
    assert torch.equal(view.select(plain.reshape(-1, 3))[:real], flat[:real])
    if per_sequence:
        assert not plain[view.padding_mask].any()  # padding reads the zero row


# ----------------------------------------------------------------------------- the model
def stock_spec_with_masked_bias_counts(config):
    """Megatron's stock local MoE spec, its router's expert-bias count fixed for a padding mask
    (0.16.1 masks ``[tokens, experts]`` with ``[tokens]``, which raises); nothing else changed."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.router import TopKRouter

    class MaskedBiasCountRouter(TopKRouter):
        def _apply_expert_bias(self, routing_map, padding_mask=None):
            if self.enable_expert_bias and torch.is_grad_enabled():
                with torch.no_grad():
                    self.local_tokens_per_expert += (routing_map & ~padding_mask[:, None]).sum(0)

    spec = get_gpt_layer_local_spec(num_experts=config["num_moe_experts"],
                                    normalization="RMSNorm")
    mlp = spec.submodules.mlp  # a ModuleSpec up to megatron-core 0.17, a partial from 0.18
    submodules = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
    submodules.router = MaskedBiasCountRouter
    return spec


def micro_batches(dp_rank: int) -> list[list[torch.Tensor]]:
    """Every sharing shape; each data-parallel rank gets its own tokens."""
    return [make_workload(name, vocab_size=PRESET.vocab_size, seed=10 * dp_rank + i,
                          **size).sequences
            for i, (name, size) in enumerate(WORKLOADS.items())]


def _statistics_run(model, batches, layout, config=PrefixSharingConfig()):
    """One pass, plus what the routers kept (:func:`router_statistics`)."""
    reset_router_statistics(model)
    run = forward_backward(model, batches, layout, config)  # grads summed over SP ranks
    return run, router_statistics(model)


def _counts_vs_each_sequence(settings: dict, batches, shared_stats: dict) -> dict[str, float]:
    """The expert-bias token counts against an independent reference: megatron's unmodified
    stock spec run on each sequence alone (one unpadded row: no padding, no mask, no fix of
    ours), its counts summed over every sequence of every micro-batch. One rank only."""
    stock = gpt_model(PRESET, layout="padded", **settings)
    stock_routers = routers(stock)
    for router in stock_routers:
        router.local_tokens_per_expert.zero_()
    for seq in (s for batch in batches for s in batch):
        stock(seq[None], torch.arange(len(seq))[None], None)  # grad enabled: counts kept
    return {f"layer{i}.tokens_per_expert": max_rel_diff(
        shared_stats[f"layer{i}.tokens_per_expert"], router.local_tokens_per_expert)
        for i, router in enumerate(stock_routers)}


def _moe_job(rank: int, variants: list[str]) -> dict:
    from megatron.core import parallel_state

    batches = micro_batches(parallel_state.get_data_parallel_rank())  # the same on every stage
    # megatron-core refuses MoE under tensor parallelism without sequence parallelism
    sequence_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
    report = {}
    for name in variants:
        settings = dict(VARIANTS[name], sequence_parallel=sequence_parallel)
        ours = gpt_model(PRESET, layout="shared", **settings)
        stock = gpt_model(PRESET, layout="padded", **settings,
                          layer_spec=stock_spec_with_masked_bias_counts(dict(
                              num_moe_experts=PRESET.num_experts)))
        shared, shared_stats = _statistics_run(ours, batches, "shared", SHARE_EVERY_PREFIX)
        padded, padded_stats = _statistics_run(stock, batches, "padded")
        same_keys(shared_stats, padded_stats, "router statistics")
        one_rank = torch.distributed.get_world_size() == 1
        report[name] = {
            "shared_vs_padded": compare(shared, padded).max_rel_diff,
            "statistics_vs_padded": {k: max_rel_diff(v, padded_stats[k])
                                     for k, v in shared_stats.items()},
            "counts_vs_each_sequence": _counts_vs_each_sequence(settings, batches, shared_stats)
            if one_rank and "expert_bias" in name else None,
            "statistic_names": sorted(padded_stats),
            "tracker": {k: v for k, v in padded_stats.items() if k.startswith("tracker.")},
            "router_grads": [k for k in padded.grads if k.endswith("router.weight")],
            "layer_numbers": [layer.layer_number for layer in ours.decoder.layers],
        }
    return report


@pytest.fixture(scope="module", params=[
    # one_rank is the exactness check CI also runs on megatron-core 0.17.1 and 0.18.2
    pytest.param(name, marks=[pytest.mark.mcore_release_check] if name == "one_rank" else [])
    for name in LAYOUTS])
def layout(request):
    world, tp, pp, variants = LAYOUTS[request.param]
    return request.param, run_distributed(_moe_job, world, variants, tp=tp, pp=pp, timeout=600)


def test_shared_moe_equals_megatron_stock_spec(layout):
    name, ranks = layout
    for rank, report in enumerate(ranks):
        for variant, r in report.items():
            for pair in ("shared_vs_padded", "statistics_vs_padded"):
                worst = {q: d for q, d in r[pair].items() if d > FP32_RTOL}
                assert not worst, f"{name} rank {rank} {variant} {pair}: {worst}"


_LOSSES = {"tracker.load_balancing_loss", "tracker.seq_load_balancing_loss",
           "tracker.global_load_balancing_loss", "tracker.z_loss",
           "layer0.global_tokens_per_expert"}
STATISTICS = {  # what each variant keeps (at least)
    "preset": _LOSSES, "recompute_full": _LOSSES,
    "expert_bias": _LOSSES | {"layer0.tokens_per_expert", "layer0.expert_bias_update"},
}


def test_expert_bias_counts_equal_the_stock_router_run_on_each_sequence(layout):
    name, ranks = layout
    if name != "one_rank":
        pytest.skip("the per-sequence reference is a one-rank run (the padded one covers TP/PP)")
    counts = ranks[0]["expert_bias"]["counts_vs_each_sequence"]
    assert len(counts) == PRESET.num_layers and not any(counts.values()), counts


def test_every_router_statistic_is_compared(layout):
    """The comparison above covers each statistic the variant keeps, and they are not zero."""
    _, ranks = layout
    for report in ranks:
        for variant, r in report.items():
            names = STATISTICS[variant]
            assert names <= set(r["statistic_names"]), variant
            for k in (k for k in names if k.startswith("tracker.")):  # this stage's layers
                assert all(r["tracker"][k][n - 1] != 0 for n in r["layer_numbers"]), k
            assert len(r["router_grads"]) == len(r["layer_numbers"])


def _expert_parallel_job(rank: int) -> dict:
    """Megatron's stock spec at EP=1 (two data-parallel ranks), then ours at EP=2 on the same
    ranks, data and seed: weights are seeded by global expert index, so the models are one.
    The launcher sets up EP=1; experts then split over the two data-parallel ranks."""
    from megatron.core import parallel_state

    batches = micro_batches(parallel_state.get_data_parallel_rank())
    stock = gpt_model(PRESET, layout="padded", **VARIANTS["expert_bias"],
                      layer_spec=stock_spec_with_masked_bias_counts(dict(
                          num_moe_experts=PRESET.num_experts)))
    ep1, ep1_stats = _statistics_run(stock, batches, "padded")
    for name, grad in ep1.grads.items():  # under EP=2 an expert computes every rank's tokens
        if ".experts." in name:
            torch.distributed.all_reduce(grad, group=parallel_state.get_data_parallel_group())
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    ours = gpt_model(PRESET, layout="shared", **VARIANTS["expert_bias"])
    ep2, ep2_stats = _statistics_run(ours, batches, "shared", SHARE_EVERY_PREFIX)
    ep1.grads = {name: ep1.grads[name] for name in ep2.grads}  # this rank's experts only
    assert ep1_stats.keys() == ep2_stats.keys()
    return {
        "shared_ep2_vs_padded_ep1": compare(ep2, ep1).max_rel_diff,
        "statistics": {k: max_rel_diff(v, ep1_stats[k]) for k, v in ep2_stats.items()},
        "experts": sorted({int(name.split("local_experts.")[1].split(".")[0])
                           for name in ep2.grads if "local_experts." in name}),
    }


def test_expert_parallel_shared_run_equals_the_stock_run_without_expert_parallelism():
    for rank, report in enumerate(run_distributed(_expert_parallel_job, 2, timeout=600)):
        assert report["experts"] == [4 * rank + i for i in range(4)]  # global expert indices
        assert STATISTICS["expert_bias"] <= set(report["statistics"])
        for pair in ("shared_ep2_vs_padded_ep1", "statistics"):
            worst = {q: d for q, d in report[pair].items() if d > FP32_RTOL}
            assert not worst, f"rank {rank} {pair}: {worst}"


def _refusals_job(rank: int) -> dict:
    from prefix_sharing.megatron_ext import UnsupportedSetupError

    batches = micro_batches(0)[:1]
    errors = {}
    for name, overrides in {
        "capacity": dict(moe_expert_capacity_factor=1.0),
        "moe_recompute": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    }.items():
        try:
            model = gpt_model(PRESET, layout="shared", **overrides)
            forward_backward(model, batches, "shared", SHARE_EVERY_PREFIX)
            forward_backward(model, batches, "packed")  # nothing shared: fine
        except UnsupportedSetupError as e:
            errors[name] = str(e)
    return errors


def test_settings_that_depend_on_the_batch_are_refused_while_sharing():
    errors = run_distributed(_refusals_job, 1, timeout=300)[0]
    assert "(moe_expert_capacity_factor=1.0): which tokens an expert drops" in errors["capacity"]

    assert "recompute_modules contains 'moe'" in errors["moe_recompute"]
