"""MoE routing replay under prefix sharing: every computed row replays its tokens' recorded
route, so shared + replay equals megatron's stock spec + replay on the padded plain batch.

Routes come from :func:`prefix_sharing.routes.recorded_routes` (a function of each token's
prefix, as a batch-invariant rollout engine records them) - once as recorded, once with one
token's route changed inside a shared prefix (:func:`diverge_inside_shared_prefix`), where the
plan must stop sharing. They are not the model's own top-k, so a run without replay differs:
the comparison shows the routes were replayed. Router variants: the preset's statistics (the
router routes the plain view), DeepSeek-V3's sigmoid + expert bias, and no statistics (the
router routes the flat rows). One rank, and TP=2 with sequence parallelism; EP=2 (on the
DeepSeek-V3-shaped ``tiny-mla``) is checked in ``test_mla.py``'s expert-parallel job.
"""

from __future__ import annotations

import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.engines.megatron import compare, forward_backward, gpt_model
from prefix_sharing.equivalence import FP32_RTOL
from prefix_sharing.presets import PRESETS, sharp
from prefix_sharing.routes import diverge_inside_shared_prefix, recorded_routes
from prefix_sharing.workloads import make_workload

from ._distributed import run_distributed

PRESET = sharp(PRESETS["tiny-moe"])  # 2 MoE layers, 8 experts, top-2
EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
VARIANTS = {
    "preset": {},
    "expert_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "no_statistics": dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                          moe_z_loss_coeff=None),
}


def batches_and_routes(diverge: bool):
    batches = [make_workload("grpo", vocab_size=PRESET.vocab_size, seed=1, num_prompts=2,
                             group_size=3).sequences,
               make_workload("tree", vocab_size=PRESET.vocab_size, seed=2, depth=2,
                             branching=2).sequences]
    routes = [recorded_routes(seqs, PRESET.num_layers, PRESET.moe_router_topk,
                              PRESET.num_experts, seed=i) for i, seqs in enumerate(batches)]
    if diverge:
        routes = [diverge_inside_shared_prefix(seqs, r, PRESET.num_experts, EVERY_PREFIX)[0]
                  for seqs, r in zip(batches, routes)]
    return batches, routes


# ----------------------------------------------------------------------------- host side
def test_diverging_routes_cut_the_plan_where_they_diverge():
    batches, routes = batches_and_routes(False)
    seqs, agree = batches[0], routes[0]
    diverged, (reader, position) = diverge_inside_shared_prefix(seqs, agree, PRESET.num_experts,
                                                                EVERY_PREFIX)
    assert build_plan(seqs, EVERY_PREFIX, routes=agree).digest() == build_plan(
        seqs, EVERY_PREFIX).digest()
    cut = build_plan(seqs, EVERY_PREFIX, routes=diverged)
    packed = torch.cat(diverged)
    token = sum(len(s) for s in seqs[:reader]) + position
    readers = (cut.kv_index == cut.kv_index[token]).nonzero()[:, 0]
    assert all(torch.equal(packed[p], packed[token]) for p in readers)  # one route per row
    assert cut.route_divergent_prefix_tokens == cut.num_tokens_unique - build_plan(
        seqs, EVERY_PREFIX).num_tokens_unique > 0


def _refusals() -> dict:
    """What each replay state sharing cannot serve raises (inside a rank)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from prefix_sharing.megatron_ext import UnsupportedSetupError

    batches, routes = batches_and_routes(False)
    batches, routes = batches[:1], routes[:1]
    errors = {}

    def attempt(name, model, **kwargs):
        try:
            forward_backward(model, batches, "shared", EVERY_PREFIX, **kwargs)
        except UnsupportedSetupError as e:
            errors[name] = str(e)

    attempt("no_flag", gpt_model(PRESET, layout="shared"), routes=routes)
    model = gpt_model(PRESET, layout="shared", moe_enable_routing_replay=True)
    for action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.RECORD):
        for layer in model.decoder.layers:
            layer.mlp.router.router_replay.set_router_replay_action(action)
        attempt(action.value, model)
    return errors


def _switch_and_refusals_job(rank: int) -> dict:
    from prefix_sharing.megatron_ext import prepare_micro_batch
    from prefix_sharing.megatron_ext.routing_replay import moe_layer_index, replaying

    seqs = [torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 7, 9, 9]), torch.tensor([5, 6])]
    routes = recorded_routes(seqs, 3, 2, 8)
    mb = prepare_micro_batch(seqs, EVERY_PREFIX, pad_to_multiple_of=4, routes=routes)
    packed = torch.cat(routes)
    flat = mb.packed_seq_params.routes
    model = gpt_model(PRESET, layout="shared", moe_enable_routing_replay=True)
    replay = model.decoder.layers[0].mlp.router.router_replay
    before = (replay.router_replay_action, replay.target_topk_idx)
    with replaying(replay, flat[:, 0]):
        inside = (replay.router_replay_action.value, replay.target_topk_idx is not None)
    config = model.config
    indices = {}
    for freq in (1, 2, [0, 1, 1, 0]):
        config.moe_layer_freq, config.num_layers = freq, 4
        indices[str(freq)] = [moe_layer_index(config, n) for n in range(1, 5)]
    return {
        "refusals": _refusals(),
        "flat_equals_packed_at_each_row": all(
            torch.equal(flat[row], packed[mb.plan.kv_index.tolist().index(row)])
            for row in range(mb.plan.num_tokens_unique)),
        "shape": tuple(flat.shape), "inside": inside,
        "restored": (replay.router_replay_action, replay.target_topk_idx) == before,
        "indices": indices,
    }


def test_flat_routes_the_replay_switch_and_refusals():
    report = run_distributed(_switch_and_refusals_job, 1, timeout=300)[0]
    assert report["flat_equals_packed_at_each_row"]
    assert report["shape"] == (8, 3, 2)  # 6 rows + 2 pad rows, 3 MoE layers, top-2
    assert report["inside"] == ("replay_forward", True) and report["restored"]
    assert report["indices"] == {"1": [0, 1, 2, 3], "2": [0, 1, 1, 2], "[0, 1, 1, 0]": [0, 0, 1, 2]}
    errors = report["refusals"]
    assert "moe_enable_routing_replay=False" in errors["no_flag"]
    assert "REPLAY_FORWARD with a sharing plan but no routes" in errors["replay_forward"]
    assert "RECORD with a sharing plan" in errors["record"]


# ----------------------------------------------------------------------------- the model
def _replay_job(rank: int, cases: list[tuple[str, bool]]) -> dict:
    """Per (router variant, diverging routes?): shared + replay against stock + replay, and the
    shared run without replay against the same stock run."""
    from megatron.core import parallel_state

    from .test_moe import stock_spec_with_masked_bias_counts

    sequence_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
    report = {}
    for name, diverge in cases:
        batches, routes = batches_and_routes(diverge)
        settings = dict(VARIANTS[name], sequence_parallel=sequence_parallel,
                        moe_enable_routing_replay=True)
        ours = gpt_model(PRESET, layout="shared", **settings)
        stock = gpt_model(PRESET, layout="padded", **settings,
                          layer_spec=stock_spec_with_masked_bias_counts(dict(
                              num_moe_experts=PRESET.num_experts)))
        shared = forward_backward(ours, batches, "shared", EVERY_PREFIX, routes=routes)
        padded = forward_backward(stock, batches, "padded", routes=routes)
        report[f"{name}/{'diverge' if diverge else 'agree'}"] = {
            "shared_vs_padded": compare(shared, padded).max_rel_diff}
    # the routes are not the model's own: without replay (last case) the log-probs differ
    native = forward_backward(ours, batches, "shared", EVERY_PREFIX)
    report["native_vs_padded"] = compare(native, padded).max_rel_diff
    return report


def _check(ranks: list[dict], cases: list[tuple[str, bool]]) -> None:
    for rank, report in enumerate(ranks):
        assert len(report) == len(cases) + 1, report.keys()
        assert report.pop("native_vs_padded")["log_probs"] > 1e-3, rank
        for case, r in report.items():
            worst = {q: d for q, d in r["shared_vs_padded"].items() if d > FP32_RTOL}
            assert not worst, f"rank {rank} {case}: {worst}"


def test_shared_replay_equals_stock_replay_on_one_rank():
    """Routes that agree (the router routing the plain view for its statistics) and routes that
    diverge inside a shared prefix (no statistics: the router routes the flat rows)."""
    cases = [("preset", False), ("no_statistics", True)]
    _check(run_distributed(_replay_job, 1, cases, timeout=600), cases)


def test_shared_replay_equals_stock_replay_under_tensor_parallelism():
    """TP=2 with sequence parallelism, diverging routes: each rank replays its slice of the
    padded plain view (sigmoid scores + expert bias keep statistics) or of the flat rows."""
    cases = [("expert_bias", True), ("no_statistics", True)]
    _check(run_distributed(_replay_job, 2, cases, tp=2, timeout=600), cases)
