"""Multi-token prediction (MTP) on the flat layout: each depth planned on its own.

Specification:

- a depth-``k`` row is shared exactly where the next ``k`` tokens agree too: each reuser
  computes its own last ``k`` prefix rows at depth ``k``;
- shared equals megatron's stock model with megatron's own MTP block on the plain packed
  micro-batch (``roll_tensor`` along each sequence, the labels and loss mask given): the main
  log-probs, each depth's logged MTP loss, and every gradient (the MTP layers', the shared
  embedding's and output layer's), fp32 within 1e-5 relative; GRPO, step-wise chain, tree with
  a duplicate and a strict prefix, no sharing; one and two depths, TP=1 and TP=2 with and
  without sequence parallelism, megatron's full activation recompute (the MTP layers' too),
  megatron's per-token loss (``calculate_per_token_loss``: each release's own rule); MoE MTP layers (router statistics included) against the padded
  run on micro-batches of equal lengths (megatron gives its MTP routers no padding mask, so pad
  tokens would count there), judged by flash-attn's rule against the float64 padded run (no
  further from it than 3x the fp32 padded run, or 1e-5): a rarely routed expert's small
  gradient rounds past 1e-5 relative in either fp32 run;
- at PP=2 (1F1B, the MTP layers on the last stage), PP=2 x VPP=2 (megatron's interleaved
  schedule, the MTP layers in the last model chunk), CP=2, and CP=2 x TP=2 with sequence
  parallelism equal to one rank;
- the MTP loss is not vacuous (it changes the gradients), and what is not planned per depth
  is refused by name.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefix_sharing import PrefixSharingConfig
from prefix_sharing.equivalence import (DEFAULT_LOW_PRECISION_FACTOR, FP32_RTOL,
                                        LOW_PRECISION_FACTOR, TENSOR_FLOOR_ULPS)
from prefix_sharing.presets import PRESETS

from ._distributed import PRESET, run_distributed
from ._equivalence import SHARE_EVERY_PREFIX, micro_batches

# the preset's own weights: sharp ones round an expert's gradient ~1.03e-5 apart at depth 2 on
# this machine's CPU (the fp32 rounding gap of summed attention sources, issue 39)
MOE = PRESETS["tiny-moe"]


def _loss_masks(seqs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """A response-style 0/1 mask per sequence: a prompt of 0s, then mostly 1s."""
    gen = torch.Generator().manual_seed(seed)
    masks = []
    for s in seqs:
        m = (torch.rand(len(s), generator=gen) < 0.8).float()
        m[: max(1, len(s) // 4)] = 0
        masks.append(m)
    return masks


def _weights(seqs: list[torch.Tensor], seed: int) -> torch.Tensor:
    """Seeded per-token weights of the main loss, 0 at each sequence's last token."""
    gen = torch.Generator().manual_seed(1000 + seed)
    parts = []
    for s in seqs:
        w = torch.randn(len(s), generator=gen)
        w[-1] = 0
        parts.append(w)
    return torch.cat(parts)


def _tracked_mtp_losses() -> torch.Tensor:
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("values", tracker.get("loss_values"))
    out = values.detach().clone().cpu()
    values.zero_()
    return out


def _labels(seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat([s[1:], s.new_zeros(1)]) for s in seqs]


def _predicting(seqs: list[torch.Tensor], log_probs: torch.Tensor) -> torch.Tensor:
    """0 at each sequence's last position, which predicts nothing (the sharing log-probs are 0
    there; megatron scores label 0)."""
    last = torch.cumsum(torch.tensor([len(s) for s in seqs]), 0) - 1
    return log_probs.index_fill(0, last, 0.0)


def _padded_step(stock, seqs, masks, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's stock model and MTP block on the right-padded ``[b, s]`` batch (labels and
    loss mask given): the main log-probs and the logged MTP losses."""
    from prefix_sharing.engines.megatron import padded_batch

    tokens, positions, _ = padded_batch(seqs, "cpu")
    labels = torch.zeros_like(tokens)
    loss_mask = torch.zeros(tokens.shape)
    for row, (lab, m) in enumerate(zip(_labels(seqs), masks)):
        labels[row, : len(lab)] = lab
        loss_mask[row, : len(m)] = m
    ce = stock(tokens, positions, None, labels=labels, loss_mask=loss_mask)
    log_probs = _predicting(seqs, -torch.cat([ce[row, : len(s)] for row, s in enumerate(seqs)]))
    (-(log_probs * weights).sum()).backward()
    return log_probs.detach(), _tracked_mtp_losses()


def _packed_step(model, seqs, masks, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, the model on megatron's plain THD packing (nothing shared): its MTP layers
    roll along each packed sequence, megatron's way."""
    from prefix_sharing.megatron_ext.packed_seq import plain_micro_batch

    mb = plain_micro_batch(seqs)
    rows = mb.token_rows
    labels = torch.zeros_like(mb.input_ids[0])
    loss_mask = torch.zeros(labels.numel())
    labels[rows] = torch.cat(_labels(seqs))
    loss_mask[rows] = torch.cat(masks)
    ce = model(mb.input_ids, mb.position_ids, None, labels=labels.unsqueeze(0),
               loss_mask=loss_mask.unsqueeze(0), packed_seq_params=mb.packed_seq_params)
    log_probs = _predicting(seqs, -ce[0].index_select(0, rows))
    (-(log_probs * weights).sum()).backward()
    return log_probs.detach(), _tracked_mtp_losses()


def _shared_step(ours, seqs, masks, weights, config) -> tuple[torch.Tensor, torch.Tensor]:
    from prefix_sharing.megatron_ext import forward_token_stats, prepare_micro_batch

    mb = prepare_micro_batch(seqs, config, mtp_num_layers=ours.config.mtp_num_layers,
                             loss_mask=masks)
    log_probs = forward_token_stats(ours, mb, with_entropy=False).log_probs
    (-(log_probs * weights).sum()).backward()
    return log_probs.detach(), _tracked_mtp_losses()


def _allowed(plain: dict[str, float]) -> dict[str, float]:
    """flash-attn's rule per compared tensor: a multiple of the fp32 plain run's distance from
    the float64 one (gradients 3x, the rest 2x), plus the tensor floor."""
    floor = torch.finfo(torch.float32).eps * TENSOR_FLOOR_ULPS
    return {q: (LOW_PRECISION_FACTOR["grads"] if q not in ("log_probs", "mtp_losses")
                else DEFAULT_LOW_PRECISION_FACTOR) * d + floor for q, d in plain.items()}


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _equal_lengths(batches: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Each micro-batch's sequences cut to its shortest (rounded down to even): the padded batch then holds no pad
    token, which megatron's MTP routers would count (no padding mask reaches them), while the
    sharing router keeps the statistics of the real tokens (:mod:`prefix_sharing.megatron_ext.moe`)."""
    cuts = [min(len(t) for t in seqs) // 2 * 2 for seqs in batches]  # even: TP=2 adds no pad
    return [[s[:cut] for s in seqs] for cut, seqs in zip(cuts, batches)]


def _mtp_job(rank: int, preset_name: str, depth: int, overrides: dict) -> dict:
    from prefix_sharing.engines.megatron import (finalize_sequence_parallel_grads, full_grads,
                                                 gpt_model)

    preset = {"tiny": PRESET, "tiny-moe": MOE}[preset_name]
    # one model per run: MoE routers keep global statistics across forwards
    models = {
        "padded": gpt_model(preset, layout="padded", mtp_num_layers=depth, **overrides),
        "padded64": gpt_model(preset, layout="padded", mtp_num_layers=depth,
                              dtype=torch.float64, **overrides),
        "packed": gpt_model(preset, layout="shared", mtp_num_layers=depth, **overrides),
        "shared": gpt_model(preset, layout="shared", mtp_num_layers=depth, **overrides),
        "unscored": gpt_model(preset, layout="shared", mtp_num_layers=depth,
                              mtp_loss_scaling_factor=0.0, **overrides),
    }
    steps = {"padded": _padded_step, "padded64": _padded_step, "packed": _packed_step,
             "shared": _shared_step,
             "unscored": _shared_step}
    report: dict = {"pairs": {}, "mtp_grads_nonzero": True, "vs_unscored": 0.0}
    batches = micro_batches() if preset_name == "tiny" else _equal_lengths(micro_batches())
    for i, seqs in enumerate(batches):
        masks, weights = _loss_masks(seqs, i), _weights(seqs, i)
        if overrides.get("calculate_per_token_loss"):  # loss on the positions a roll drops,
            masks = [torch.ones(len(s)) for s in seqs]  # where the releases' rules differ
        runs, grads = {}, {}
        for name, step in steps.items():
            model = models[name]
            model.zero_grad(set_to_none=True)
            extra = (SHARE_EVERY_PREFIX,) if step is _shared_step else ()
            runs[name] = step(model, seqs, masks, weights, *extra)
            finalize_sequence_parallel_grads(model)
            grads[name] = full_grads(model)
        # megatron's THD router reads a packed micro-batch as one sequence (seq_aux_loss), the
        # sharing one per sequence, as on the padded batch: MoE is compared with the padded run
        pairs = [("shared", "padded64"), ("padded", "padded64"), ("shared", "padded")]
        if preset_name == "tiny":
            pairs.append(("shared", "packed"))
        for run, ref in pairs:
            pair = report["pairs"].setdefault(f"{run}_vs_{ref}", {})
            for what, k in (("log_probs", 0), ("mtp_losses", 1)):
                pair[what] = max(pair.get(what, 0.0), _max_rel(runs[run][k], runs[ref][k]))
            for name, g in grads[ref].items():
                pair[name] = max(pair.get(name, 0.0), _max_rel(grads[run][name], g))
        # every MTP weight gets a gradient, but an expert no token was routed to
        report["mtp_grads_nonzero"] &= all(bool(g.abs().sum() > 0)
                                           for n, g in grads["padded"].items()
                                           if n.startswith("mtp.") and ".local_experts." not in n)
        report["vs_unscored"] = max(report["vs_unscored"], max(
            _max_rel(grads["unscored"][n], grads["shared"][n])
            for n in grads["shared"] if n.startswith("decoder.")))
        report["mtp_params"] = sorted(n for n in grads["shared"] if n.startswith("mtp."))
    return report


CASES = {
    "depth1_tp1": ("tiny", 1, 1, {}),
    "depth2_tp1": ("tiny", 2, 1, {}),
    "depth1_tp2": ("tiny", 1, 2, {}),
    "depth2_tp1_full_recompute": ("tiny", 2, 1, dict(recompute_granularity="full",
                                                     recompute_method="uniform",
                                                     recompute_num_layers=1)),
    "depth2_tp2_sequence_parallel": ("tiny", 2, 2, {"sequence_parallel": True}),
    # megatron's per-token loss: 0.16 attaches each depth's sum, 0.19 rescales it
    "depth2_tp1_per_token_loss": ("tiny", 2, 1, {"calculate_per_token_loss": True}),
    "moe_depth2_tp1": ("tiny-moe", 2, 1, {}),
    "moe_depth1_tp2_sequence_parallel": ("tiny-moe", 1, 2, {"sequence_parallel": True}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    preset, depth, tp, overrides = CASES[request.param]
    return request.param, run_distributed(_mtp_job, tp, preset, depth, overrides, tp=tp, pp=1,
                                          timeout=900)


def test_shared_mtp_equals_megatrons_mtp_block_on_the_plain_batch(case):
    name, ranks = case
    for rank, report in enumerate(ranks):
        pairs = report["pairs"]
        for pair in ("shared_vs_padded", "shared_vs_packed"):  # the fixed fp32 rule
            worst = {q: d for q, d in pairs.get(pair, {}).items() if d > FP32_RTOL}
            assert not worst or pair == "shared_vs_padded" and name.startswith("moe"), (
                f"{name} rank {rank} {pair}: {worst}")
        # and flash-attn's rule against the float64 run: a rarely routed expert's small
        # gradient can round past 1e-5 relative in either fp32 run (module doc)
        allowed = _allowed(pairs["padded_vs_padded64"])
        worst = {q: (d, allowed[q]) for q, d in pairs["shared_vs_padded64"].items()
                 if d > max(allowed[q], FP32_RTOL)}
        assert not worst, f"{name} rank {rank} vs float64: {worst}"
        assert report["mtp_params"], "no MTP parameter was compared"


def test_the_mtp_loss_reaches_the_decoder_and_every_mtp_weight(case):
    name, ranks = case
    for report in ranks:
        assert report["mtp_grads_nonzero"], name
        assert report["vs_unscored"] > 1e-3, (name, report["vs_unscored"])


def test_a_depth_shares_a_row_only_where_the_next_tokens_agree():
    from prefix_sharing.megatron_ext.mtp import plan_mtp_depths  # needs megatron-core
    from prefix_sharing.planner import build_plan

    a = torch.tensor([5, 6, 7, 8, 3, 3])
    b = torch.tensor([5, 6, 7, 8, 9])
    c = torch.tensor([5, 6, 7])  # a strict prefix of both
    config = PrefixSharingConfig(min_prefix_len=1)
    plan = build_plan([a, b, c], config)
    assert plan.prefix_lens == (0, 4, 3)
    depth1, depth2 = plan_mtp_depths([a, b, c], plan, 2, config)
    # depth k: each reuser shares k rows fewer (b's row 3 reads 3 or 9, c's row 2 reads past
    # its end), whoever provides them
    assert [sum(p.prefix_lens) for p in (plan, depth1.plan, depth2.plan)] == [7, 5, 3]
    assert depth2.plan.num_tokens_flat == plan.num_tokens_flat + 4
    # the rolled tokens a row embeds and the labels each position scores, megatron's roll
    rows_a = depth1.plan.kv_index[:6]
    assert depth1.input_ids[0, rows_a].tolist() == [6, 7, 8, 3, 3, 0]
    assert depth2.targets[:6].tolist() == [8, 3, 3, 0, 0, 0]
    # default loss mask: 1 but at the last position, rolled k along each sequence
    assert depth1.weights[:6].tolist() == [1, 1, 1, 1, 0, 0]
    # each depth-1 row reads the decoder row of its own (sequence, position)
    assert torch.equal(depth1.from_previous[rows_a], plan.kv_index[:6])


def _built_stock_job(rank: int) -> dict:
    """A model whose MTP block spec megatron built around the sharing layer spec (as
    Megatron-Bridge does inside its provider), made sharing after the build; then a forward
    planned without the depths."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from prefix_sharing.engines.megatron import gpt_model, transformer_config
    from prefix_sharing.megatron_ext import (UnsupportedSetupError, check_sharing_model,
                                             forward_token_stats,
                                             get_gpt_layer_local_spec, prepare_micro_batch,
                                             share_multi_token_prediction)

    reference = gpt_model(PRESET, layout="shared", mtp_num_layers=1)
    config = transformer_config(PRESET, mtp_num_layers=1)
    layer = get_gpt_layer_local_spec()
    model = GPTModel(config=config, transformer_layer_spec=layer,
                     mtp_block_spec=get_gpt_mtp_block_spec(config, layer,
                                                           use_transformer_engine=False),
                     vocab_size=PRESET.vocab_size,
                     max_sequence_length=PRESET.max_sequence_length,
                     share_embeddings_and_output_weights=PRESET.tie_embeddings,
                     position_embedding_type="rope", rotary_base=PRESET.rotary_base)
    model.load_state_dict(reference.state_dict())
    found = {}
    try:
        check_sharing_model(model)
    except UnsupportedSetupError as error:
        found["before"] = str(error)
    share_multi_token_prediction(model)
    check_sharing_model(model)
    found["classes"] = {type(layer).__name__ for layer in model.mtp.layers}
    seqs = micro_batches(["grpo"])[0]
    for name, net in (("rebuilt", model), ("reference", reference)):
        mb = prepare_micro_batch(seqs, SHARE_EVERY_PREFIX, mtp_num_layers=1)
        forward_token_stats(net, mb, with_entropy=False).log_probs.sum().backward()
        found[name] = {n: p.grad.clone() for n, p in net.named_parameters()}
    model.zero_grad(set_to_none=True)
    mb = prepare_micro_batch(seqs, SHARE_EVERY_PREFIX, mtp_num_layers=0)
    log_probs = forward_token_stats(model, mb, with_entropy=False).log_probs
    log_probs.sum().backward()
    found["unrun_mtp_grads"] = [n for n, p in model.named_parameters()
                                if n.startswith("mtp.") and p.grad is not None]
    found["unrun_decoder_grad"] = model.decoder.layers[0].mlp.linear_fc1.weight.grad.clone()
    return found


def test_mtp_layers_built_stock_around_the_sharing_layer_become_the_sharing_ones():
    """Megatron-Bridge builds the MTP block spec from the layer spec inside its provider:
    ``share_multi_token_prediction`` makes those layers the sharing one (the model check
    refuses them before), with the spec-built model's gradients; a forward planned with
    ``mtp_num_layers=0`` does not run them (verl's forward when it does not train them)."""
    (found,) = run_distributed(_built_stock_job, 1)
    assert "stock MTP layers" in found["before"] and "[megatron.mtp]" in found["before"]
    assert found["classes"] == {"PrefixSharingMTPLayer"}
    for name, grad in found["reference"].items():
        assert torch.allclose(found["rebuilt"][name], grad, rtol=0, atol=0), name
    assert found["unrun_mtp_grads"] == []
    assert found["unrun_decoder_grad"].abs().sum() > 0


def _head_inputs_job(rank: int) -> str:
    from prefix_sharing.engines.megatron import gpt_model
    from prefix_sharing.megatron_ext import lm_head_inputs, prepare_micro_batch

    model = gpt_model(PRESET, layout="shared", mtp_num_layers=1)
    mb = prepare_micro_batch(micro_batches(["grpo"])[0], SHARE_EVERY_PREFIX, mtp_num_layers=1)
    try:
        with lm_head_inputs(model):
            model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
    except ValueError as error:
        return str(error)
    return "ran"


def test_the_head_inputs_path_refuses_to_score_mtp_depths_from_hidden_states():
    """Under ``lm_head_inputs`` the output layer returns its input: the depths' losses would be
    read from hidden states, so the sharing postprocess raises."""
    (message,) = run_distributed(_head_inputs_job, 1)
    assert "lm_head_inputs" in message, message


def test_settings_not_planned_per_depth_are_refused():
    from prefix_sharing.megatron_ext.checks import mtp_problems

    @dataclasses.dataclass
    class Config:
        mtp_num_layers: int | None = 1
        context_parallel_size: int = 1
        pipeline_model_parallel_size: int = 1
        virtual_pipeline_model_parallel_size: int | None = None
        moe_enable_routing_replay: bool = False
        calculate_per_token_loss: bool = False

    assert mtp_problems(Config()) == []
    assert mtp_problems(Config(mtp_num_layers=None, context_parallel_size=2)) == []
    assert mtp_problems(Config(pipeline_model_parallel_size=2, context_parallel_size=2)) == []
    assert mtp_problems(Config(virtual_pipeline_model_parallel_size=2)) == []  # served
    (found,) = mtp_problems(Config(moe_enable_routing_replay=True))
    assert found.key == "megatron.mtp" and "routing_replay" in found.detail
    assert mtp_problems(Config(calculate_per_token_loss=True)) == []  # served at CP=1
    (found,) = mtp_problems(Config(calculate_per_token_loss=True, context_parallel_size=2))
    assert "calculate_per_token_loss" in found.detail


def _parallel_job(rank: int, depth: int, overrides: dict, layers: int) -> dict:
    """The shared run through megatron's schedule on this rank's layout (PP: 1F1B, MTP on the
    last stage; under interleaved stages its last model chunk; CP: the gradients averaged over
    the group, as megatron does) of a ``layers``-layer model; under PP the MTP block's copy of
    the embedding is summed into the first stage's, as megatron's ``finalize_model_grads``
    sums the embedding group's."""
    from megatron.core import parallel_state

    from prefix_sharing.engines.megatron import forward_backward, model_chunks

    preset = dataclasses.replace(PRESET, num_layers=layers)
    chunks = model_chunks(preset, mtp_num_layers=depth, **overrides)
    run = forward_backward(chunks, micro_batches(), "shared", SHARE_EVERY_PREFIX)
    grads = dict(run.grads)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name = "embedding.word_embeddings.weight"
        grad = grads.get(name, torch.zeros(PRESET.vocab_size, PRESET.hidden_size))
        torch.distributed.all_reduce(grad)
        grads[name] = grad
        if not parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            grads.pop(name)  # the first stage's is compared
    return {"grads": grads, "log_probs": [o.log_probs for o in run.outputs]}


PARALLEL = {  # world, run_distributed's layout, model overrides, layers
    "pp2": (2, dict(pp=2), {}, 2),
    # megatron's interleaved schedule at PP=2 with overlapped p2p, as verl and Megatron-LM set it
    "pp2_vpp2": (2, dict(pp=2, vpp=2), dict(overlap_p2p_comm=True, batch_p2p_comm=False), 4),
    "cp2": (2, dict(cp=2), {}, 2),
    "cp2_tp2_sequence_parallel": (4, dict(cp=2, tp=2), {"sequence_parallel": True}, 2),
}


@pytest.mark.parametrize("layout", list(PARALLEL))
def test_mtp_under_pipeline_and_context_parallelism_equals_the_single_rank_run(layout):
    """Against one rank, whose MTP is exact against megatron's (above)."""
    world, parallel, overrides, layers = PARALLEL[layout]
    (single,) = run_distributed(_parallel_job, 1, 2, {}, layers)
    ranks = run_distributed(_parallel_job, world, 2, overrides, layers, **parallel, timeout=900)
    compared = set()
    for rank in ranks:
        for name, grad in rank["grads"].items():
            assert _max_rel(grad, single["grads"][name]) <= FP32_RTOL, (layout, name)
            compared.add(name)
        for ours, ref in zip(rank["log_probs"], single["log_probs"]):
            assert _max_rel(ours, ref) <= FP32_RTOL, layout
    assert compared == set(single["grads"]), set(single["grads"]) ^ compared
    assert any(n.startswith("mtp.") for n in compared)
