"""MoE routing replay under prefix sharing: every computed row replays its tokens' recorded
route, so shared + replay equals megatron's stock spec + replay on the padded plain batch.

Routes come from :func:`prefix_sharing.routes.recorded_routes` (a function of each token's
prefix, as a batch-invariant rollout engine records them) - once as recorded, once with one
token's route changed inside a shared prefix (:func:`diverge_inside_shared_prefix`), where the
plan must stop sharing. They are not the model's own top-k, so a run without replay differs:
the comparison shows the routes were replayed. Router variants: the preset's statistics (the
router routes the plain view), DeepSeek-V3's sigmoid + expert bias, and no statistics (the
router routes the flat rows). One rank, TP=2 with sequence parallelism, and CP=2; EP=2 (on the
DeepSeek-V3-shaped ``tiny-mla``) is checked in ``test_mla.py``'s expert-parallel job.

Recording (verl's R2 records routes in one forward to replay them later): a no-grad sharing
forward planned with ``record_routes=True`` records the flat rows, and ``recorded_routes`` hands
every plain token its row's route - equal to what the stock spec records on the padded batch.
"""

from __future__ import annotations

import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.engines.megatron import compare, forward_backward, gpt_model, padded_batch
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

    from prefix_sharing.megatron_ext import UnsupportedSetupError, prepare_micro_batch

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
    # a forward planned to record: with grad the preset's router keeps statistics (it would
    # record the plain view), and without RECORD there is nothing to record
    mb = prepare_micro_batch(batches[0], EVERY_PREFIX, device="cpu", record_routes=True)
    for name, action in (("record_with_grad", RouterReplayAction.RECORD),
                         ("record_no_action", None)):
        for layer in model.decoder.layers:
            layer.mlp.router.router_replay.router_replay_action = action
        try:
            model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
        except UnsupportedSetupError as e:
            errors[name] = str(e)
    return errors


def _switch_and_refusals_job(rank: int) -> dict:
    from prefix_sharing.megatron_ext import UnsupportedSetupError, prepare_micro_batch
    from prefix_sharing.megatron_ext.routing_replay import (moe_layer_index, replaying,
                                                           route_column)

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
    # routes that diverge shape the plan without being replayed (a stage that does not replay)
    diverged, _ = diverge_inside_shared_prefix(seqs, routes, 8, EVERY_PREFIX)
    cut = prepare_micro_batch(seqs, EVERY_PREFIX, pad_to_multiple_of=4, routes=diverged)
    planned_only = prepare_micro_batch(seqs, EVERY_PREFIX, pad_to_multiple_of=4, routes=diverged,
                                       replay_routes=False)
    # routes of the MoE layers only, or of every layer (verl's R3, dense layers included)
    columns = {width: [route_column(config, n, width) for n in (2, 3)] for width in (2, 4)}
    try:
        route_column(config, 2, 3)
    except UnsupportedSetupError as e:
        columns[3] = str(e)
    return {
        "planned_only": (planned_only.packed_seq_params.routes is None,
                         planned_only.plan.digest() == cut.plan.digest() != mb.plan.digest()),
        "refusals": _refusals(),
        "flat_equals_packed_at_each_row": all(
            torch.equal(flat[row], packed[mb.plan.kv_index.tolist().index(row)])
            for row in range(mb.plan.num_tokens_unique)),
        "shape": tuple(flat.shape), "inside": inside,
        "restored": (replay.router_replay_action, replay.target_topk_idx) == before,
        "indices": indices, "columns": columns,
    }


def test_flat_routes_the_replay_switch_and_refusals():
    report = run_distributed(_switch_and_refusals_job, 1, timeout=300)[0]
    assert report["flat_equals_packed_at_each_row"]
    assert report["planned_only"] == (True, True)
    assert report["shape"] == (8, 3, 2)  # 6 rows + 2 pad rows, 3 MoE layers, top-2
    assert report["inside"] == ("replay_forward", True) and report["restored"]
    assert report["indices"] == {"1": [0, 1, 2, 3], "2": [0, 1, 1, 2], "[0, 1, 1, 0]": [0, 0, 1, 2]}
    # the shared and the stock replay both pick columns so (a stock replay that took the MoE
    # ordinal of R3-wide routes failed `verify --model tiny-mla --routing-replay`)
    assert report["columns"][2] == [0, 1] and report["columns"][4] == [1, 2]
    assert "hold 3 layers; this model has 2 MoE layers of 4" in report["columns"][3]
    errors = report["refusals"]
    assert "moe_enable_routing_replay=False" in errors["no_flag"]
    assert ("replay without routes on the micro-batch (router replay action REPLAY_FORWARD)"
            in errors["replay_forward"])
    assert "RECORD with a sharing plan" in errors["record"]
    assert "keeps router statistics" in errors["record_with_grad"]
    assert "without the record action (the router replay action is None)" in errors[
        "record_no_action"]



# ----------------------------------------------------------------------------- the model
def _settings(name: str) -> dict:
    from megatron.core import parallel_state

    # megatron-core refuses MoE under tensor parallelism without sequence parallelism
    sequence_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
    return dict(VARIANTS[name], sequence_parallel=sequence_parallel,
                moe_enable_routing_replay=True)


def _stock_replay_job(rank: int, cases: list[tuple[str, bool]]) -> dict:
    """Megatron's stock spec + replay on the padded batch, per case."""
    runs = {}
    for name, diverge in cases:
        batches, routes = batches_and_routes(diverge)
        runs[name, diverge] = forward_backward(_stock_model(name), batches, "padded",
                                               routes=routes)
    return runs


def _stock_model(name: str):
    from .test_moe import stock_spec_with_masked_bias_counts

    return gpt_model(PRESET, layout="padded", **_settings(name),
                     layer_spec=stock_spec_with_masked_bias_counts(dict(
                         num_moe_experts=PRESET.num_experts)))


def _replay_job(rank: int, cases: list[tuple[str, bool]], stock: dict | None = None) -> dict:
    """Per (router variant, diverging routes?): shared + replay against stock + replay, and the
    shared run without replay against the same stock run. ``stock``: the stock runs, made
    elsewhere (at context-parallel size 1, where megatron's own attention runs); else here, and
    then also both models' recordings (recording while sharing is refused under CP)."""
    records = stock is None
    stock = _stock_replay_job(rank, cases) if stock is None else stock
    report = {}
    for name, diverge in cases:
        batches, routes = batches_and_routes(diverge)
        ours = gpt_model(PRESET, layout="shared", **_settings(name))
        shared = forward_backward(ours, batches, "shared", EVERY_PREFIX, routes=routes)
        padded = stock[name, diverge]
        report[f"{name}/{'diverge' if diverge else 'agree'}"] = {
            "shared_vs_padded": compare(shared, padded).max_rel_diff}
    # the routes are not the model's own: without replay (last case) the log-probs differ
    native = forward_backward(ours, batches, "shared", EVERY_PREFIX)
    report["native_vs_padded"] = compare(native, padded).max_rel_diff
    if records:
        report["recorded"] = _recordings(ours, _stock_model(name), batches[0])
    return report


def _recordings(ours, stock, seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """Every plain token's route ``[T_total, moe_layers, topk]`` as a no-grad forward records
    it: the sharing model's (its flat rows, through ``recorded_routes``) and the stock model's
    on the right-padded batch (its router sees ``[s, b]`` s-major, this rank's slice of ``s``
    under sequence parallelism)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from prefix_sharing.megatron_ext import prepare_micro_batch
    from prefix_sharing.megatron_ext.routing_replay import recorded_routes

    def record(model):
        for layer in model.decoder.layers:
            layer.mlp.router.router_replay.clear_indices()
            layer.mlp.router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tokens, positions, padding = padded_batch(seqs, "cpu")
    longest = tokens.size(1)
    with torch.no_grad():
        record(ours)
        mb = prepare_micro_batch(seqs, EVERY_PREFIX, device="cpu", record_routes=True)
        ours(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
        shared = recorded_routes(ours, mb.plan)
        record(stock)
        stock(tokens, positions, None, padding_mask=padding)
        rows = torch.stack([layer.mlp.router.router_replay.recorded_topk_idx
                            for layer in stock.decoder.layers], dim=1)  # [s / TP * b, L, k]
        if tp > 1:
            rows = gather_from_sequence_parallel_region(rows, tensor_parallel_output_grad=False)
        rows = rows.view(longest, len(seqs), *rows.shape[1:])  # [s, b, L, k]
        plain = torch.cat([rows[: len(s), j] for j, s in enumerate(seqs)])
    return shared, plain


def _check(ranks: list[dict], cases: list[tuple[str, bool]], recorded: bool = True) -> None:
    for rank, report in enumerate(ranks):
        assert len(report) == len(cases) + 1 + recorded, report.keys()
        assert report.pop("native_vs_padded")["log_probs"] > 1e-3, rank
        if recorded:
            shared, plain = report.pop("recorded")
            assert shared.shape == plain.shape == (plain.size(0), PRESET.num_layers,
                                                   PRESET.moe_router_topk), rank
            assert torch.equal(shared, plain), f"rank {rank}: recorded routes differ"
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


def test_shared_replay_under_context_parallelism_equals_stock_replay_at_cp1():
    """CP=2: each rank replays the routes of its slice - of the padded plain view its router
    routes for the statistics (routes that agree), of the flat rows without statistics (a route
    diverging inside a shared prefix) - against the stock spec + replay on one rank."""
    cases = [("preset", False), ("no_statistics", True)]
    stock = run_distributed(_stock_replay_job, 1, cases, timeout=600)[0]
    _check(run_distributed(_replay_job, 2, cases, stock, cp=2, timeout=600), cases, recorded=False)
