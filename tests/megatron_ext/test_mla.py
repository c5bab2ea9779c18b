"""Multi-latent attention under prefix sharing computes what megatron's stock MLA computes.

The ``tiny-mla`` preset is DeepSeek-V3's shape in small: MLA with q LoRA (q/k 24 channels per
head, 8 of them rotary; v 16), a dense first layer, then MoE layers of 8 experts, top-2, with a
shared expert, sigmoid scores and an expert bias. Each variant runs GRPO, tree, agent and
unshared micro-batches through megatron's schedule shared and on megatron's stock MLA spec on
the padded batch, and compares logits, log-probs, entropy, loss and every gradient (fp32:
within 1e-5 relative); the preset also on the plain packed layout (megatron's own THD MLA RoPE,
forward quantities). Variants: the preset (megatron's one MLA rotary layout: the rotary slice
de-interleaved, then rotate-half; ``rotary_interleaved=True`` is refused by megatron's MLA
config), and YaRN with an mscale that is not 1 on a model without q LoRA (megatron's
``linear_q_proj`` path) nor norms on the compressed q and kv.

Independent reference: the same weights copied into transformers' DeepseekV3, run plainly one
sequence at a time, against the shared run in float64: log-probs, entropy, loss and every
gradient (router losses off, which transformers does not compute).

Parallel: TP=2 (sequence parallel, heads split), PP=2 (3 layers split 1 + 2) and EP=2 (experts
split), one 2-rank job each; the EP=2 job also replays recorded routes (routing replay, routes
that agree and routes that diverge inside a shared prefix) against the stock spec + replay.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefix_sharing.engines.megatron import compare, forward_backward, gpt_model
from prefix_sharing.equivalence import (FP32_RTOL, advantages, max_rel_diff, pg_loss,
                                        plain_token_log_probs)
from prefix_sharing.presets import PRESETS, sharp

from ._distributed import run_distributed
from ._equivalence import SHARE_EVERY_PREFIX, micro_batches

PRESET = sharp(PRESETS["tiny-mla"])
WORKLOADS = ["grpo", "tree", "agent", "none"]
VARIANTS = {
    "preset": {},
    "yarn_without_q_lora": dict(rope_type="yarn", rotary_scaling_factor=4.0,
                                original_max_position_embeddings=16, mscale=1.0,
                                mscale_all_dim=0.5, q_lora_rank=None,
                                # no q norm without q LoRA (0.19 refuses one); kv norm goes too
                                qk_layernorm=False),
}
# the multi-rank jobs and the transformers reference: a reuser with a strict prefix and
# duplicates (tree), and branches of turns over a shared system prompt (agent)
FEWER_WORKLOADS = ["tree", "agent"]
FORWARD = ("logits", "log_probs", "entropy", "loss")
CHANGES_THE_MODEL = {"yarn_without_q_lora"}  # moves megatron's own log-probs: the check has power


def _equivalence_job(rank: int, variants: list[str], workloads: list[str]) -> dict:
    """Each variant shared and on megatron's stock MLA spec (padded); the preset also on the
    plain packed layout (megatron's own THD MLA through the sharing core attention), whose
    forward quantities must match (its router losses treat the packed batch as one sequence,
    so its gradients are not the padded batch's)."""
    from megatron.core import parallel_state

    sequence_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
    batches = micro_batches(workloads)
    report, baseline = {}, None
    for name in variants:
        settings = dict(VARIANTS[name], sequence_parallel=sequence_parallel)
        ours = gpt_model(PRESET, layout="shared", **settings)
        stock = gpt_model(PRESET, layout="padded", **settings)
        shared = forward_backward(ours, batches, "shared", SHARE_EVERY_PREFIX)
        padded = forward_backward(stock, batches, "padded")
        report[name] = {"shared_vs_padded": compare(shared, padded).max_rel_diff,
                        "grads": len(shared.grads)}
        if name == "preset":
            packed = compare(forward_backward(ours, batches, "packed"), padded).max_rel_diff
            report[name]["packed_vs_padded"] = {q: packed[q] for q in FORWARD}
            baseline = padded
        elif baseline is not None:  # how far the variant moves megatron's own log-probs
            report[name]["moved"] = max(max_rel_diff(a.log_probs, b.log_probs)
                                        for a, b in zip(padded.outputs, baseline.outputs))
    return report


def _check(ranks: list[dict], min_grads: int = 20) -> None:
    for rank, report in enumerate(ranks):
        for variant, r in report.items():
            for pair in ("shared_vs_padded", "packed_vs_padded"):
                worst = {q: d for q, d in r.get(pair, {}).items() if d > FP32_RTOL}
                assert not worst, f"rank {rank} {variant} {pair}: {worst}"
            assert r["grads"] > min_grads, (variant, r["grads"])  # every parameter's gradient
            if variant in CHANGES_THE_MODEL:  # the variant changes the model: the check has power
                assert r["moved"] > 1e-3, (variant, r["moved"])


def _host_reads_job(num_layers: int, num_prompts: int) -> dict[str, int]:
    """Host reads of one planned forward+backward of a dense MLA model (MoE's dispatcher reads
    its split sizes per layer, sharing or not, so it is left out here)."""
    from prefix_sharing import PrefixSharingConfig
    from prefix_sharing.megatron_ext import prepare_micro_batch
    from prefix_sharing.workloads import make_workload
    from tests.attention.host_reads import count_host_reads

    dense = dataclasses.replace(PRESET, num_layers=num_layers, num_experts=None,
                                first_dense_layers=0)
    model = gpt_model(dense, layout="shared")
    sequences = make_workload("grpo", vocab_size=PRESET.vocab_size, seed=0,
                              num_prompts=num_prompts, group_size=3).sequences
    mb = prepare_micro_batch(sequences, PrefixSharingConfig(min_prefix_len=1, backend="torch"),
                             device="cpu")
    assert mb.plan.has_sharing

    def step() -> None:
        logits = model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
        logits.float().square().mean().backward()

    return count_host_reads(step)


def _one_rank_job(rank: int) -> dict:
    return {"megatron": _equivalence_job(rank, list(VARIANTS), WORKLOADS),
            "transformers": _transformers_job(rank),
            "host_reads": {size: _host_reads_job(*size) for size in ((2, 2), (4, 2), (2, 4))}}


@pytest.fixture(scope="module")
def one_rank() -> dict:
    """One spawned rank for both one-rank checks (a spawn and megatron's import cost seconds)."""
    return run_distributed(_one_rank_job, 1, timeout=900)[0]


def test_shared_mla_equals_megatron_stock_mla_on_one_rank(one_rank):
    _check([one_rank["megatron"]])


def test_shared_mla_step_reads_do_not_grow_with_layers_or_segments(one_rank):
    """The per-token rotary table replaces megatron's per-segment THD RoPE loop: doubling the
    layers or the attention segments adds no device-to-host read (see test_host_syncs.py)."""
    reads = one_rank["host_reads"]
    assert reads[(4, 2)] == reads[(2, 2)] == reads[(2, 4)], reads


def test_shared_mla_equals_megatron_stock_mla_under_tensor_parallelism():
    _check(run_distributed(_equivalence_job, 2, ["preset"], FEWER_WORKLOADS, tp=2, timeout=900))


def _pipeline_job(rank: int) -> tuple[dict, list[int]]:
    """The equivalence job on this stage, and the global numbers of the stage's layers."""
    report = _equivalence_job(rank, ["preset"], FEWER_WORKLOADS)
    return report, [layer.layer_number for layer in gpt_model(PRESET).decoder.layers]


def test_shared_mla_equals_megatron_stock_mla_under_pipeline_parallelism():
    """PP=2 splits the 3 layers unevenly, as DeepSeek-V3's recipes do: the dense layer on the
    first stage, both MoE layers on the last; each stage hands its own layers the plan."""
    (first, first_layers), (last, last_layers) = run_distributed(_pipeline_job, 2, pp=2,
                                                                 timeout=900)
    assert (first_layers, last_layers) == ([1], [2, 3])
    _check([first, last], min_grads=10)  # the first stage: the embedding and one dense layer
    assert first["preset"]["grads"] + last["preset"]["grads"] > 40


# ----------------------------------------------------------------------------- expert parallel
def replayed_routes(batches: list) -> dict[str, list]:
    """Recorded routes of every micro-batch (``[L_i, 2 MoE layers, top-2]`` per sequence): as
    recorded, and with one token's route changed inside a shared prefix."""
    from prefix_sharing.routes import diverge_inside_shared_prefix, recorded_routes

    moe_layers = PRESET.num_layers - PRESET.first_dense_layers
    agree = [recorded_routes(seqs, moe_layers, PRESET.moe_router_topk, PRESET.num_experts, seed=i)
             for i, seqs in enumerate(batches)]
    diverge = [diverge_inside_shared_prefix(seqs, r, PRESET.num_experts, SHARE_EVERY_PREFIX)[0]
               for seqs, r in zip(batches, agree)]
    return {"agree": agree, "diverge": diverge}


def _expert_parallel_job(rank: int) -> dict:
    """Megatron's stock MLA spec at EP=1 (two data-parallel ranks), then ours at EP=2 on the
    same ranks, data and seed (weights are seeded by global expert index); each without
    routing replay, and replaying routes that agree and routes that diverge inside a shared
    prefix (stock + replay on the padded batch against shared + replay)."""
    from megatron.core import parallel_state

    batches = micro_batches(FEWER_WORKLOADS)
    routes = replayed_routes(batches)
    stock = gpt_model(PRESET, layout="padded")
    stock_replay = gpt_model(PRESET, layout="padded", moe_enable_routing_replay=True)
    ep1 = {"native": forward_backward(stock, batches, "padded")}
    ep1.update({case: forward_backward(stock_replay, batches, "padded", routes=r)
                for case, r in routes.items()})
    for run in ep1.values():  # under EP=2 an expert computes every rank's tokens
        for name, grad in run.grads.items():
            if ".experts." in name:
                torch.distributed.all_reduce(grad)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    ours = gpt_model(PRESET, layout="shared")
    ours_replay = gpt_model(PRESET, layout="shared", moe_enable_routing_replay=True)
    ep2 = {"native": forward_backward(ours, batches, "shared", SHARE_EVERY_PREFIX)}
    ep2.update({case: forward_backward(ours_replay, batches, "shared", SHARE_EVERY_PREFIX,
                                       routes=r) for case, r in routes.items()})
    report = {}
    for case, run in ep2.items():
        ep1[case].grads = {name: ep1[case].grads[name] for name in run.grads}  # this rank's
        report[case] = compare(run, ep1[case]).max_rel_diff
    return {"shared_ep2_vs_padded_ep1": report,
            "replay_moves_the_model": max(max_rel_diff(a.log_probs, b.log_probs) for a, b in
                                          zip(ep1["agree"].outputs, ep1["native"].outputs)),
            "experts": sorted({int(n.split("local_experts.")[1].split(".")[0])
                               for n in ep2["native"].grads if "local_experts." in n})}


@pytest.fixture(scope="module")
def expert_parallel() -> list[dict]:
    return run_distributed(_expert_parallel_job, 2, timeout=900)


def test_shared_mla_under_expert_parallelism_equals_the_stock_run_without_it(expert_parallel):
    for rank, report in enumerate(expert_parallel):
        assert report["experts"] == [4 * rank + i for i in range(4)]
        r = report["shared_ep2_vs_padded_ep1"]["native"]
        worst = {q: d for q, d in r.items() if d > FP32_RTOL}
        assert not worst, f"rank {rank}: {worst}"


def test_routing_replay_under_expert_parallelism_equals_stock_replay(expert_parallel):
    """Shared + replay at EP=2 against the stock spec + replay at EP=1 on the padded batch,
    routes that agree and routes that diverge inside a shared prefix (the plan stops sharing
    there). The routes are not the model's own: replaying them moves the stock run's log-probs,
    so the comparison shows they were replayed."""
    for rank, report in enumerate(expert_parallel):
        assert report["replay_moves_the_model"] > 1e-3, rank
        for case in ("agree", "diverge"):
            r = report["shared_ep2_vs_padded_ep1"][case]
            worst = {q: d for q, d in r.items() if d > FP32_RTOL}
            assert not worst, f"rank {rank} {case}: {worst}"


# ----------------------------------------------------------------------------- transformers
NO_ROUTER_LOSSES = dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                        moe_z_loss_coeff=None)


def _transformers_job(rank: int) -> dict:
    from ._deepseek_v3 import hf_model, load_megatron_weights, to_hf_names

    batches = micro_batches(FEWER_WORKLOADS)
    ours = gpt_model(PRESET, layout="shared", dtype=torch.float64, **NO_ROUTER_LOSSES)
    shared = forward_backward(ours, batches, "shared", SHARE_EVERY_PREFIX)
    hf = hf_model(PRESET, dict(moe_router_topk_scaling_factor=ours.config.moe_router_topk_scaling_factor))
    load_megatron_weights(hf, ours)
    differences: dict[str, float] = {}
    for i, (seqs, out) in enumerate(zip(batches, shared.outputs)):
        logits = torch.cat([hf(input_ids=s[None]).logits[0] for s in seqs])  # one at a time
        log_probs, entropy = plain_token_log_probs(logits, list(seqs))
        loss = pg_loss(log_probs, entropy, advantages(log_probs.numel(), seed=i))
        (loss / len(batches)).backward()  # megatron's schedule averages over micro-batches
        for q, (a, b) in dict(log_probs=(out.log_probs, log_probs), entropy=(out.entropy, entropy),
                              loss=(out.loss, loss)).items():
            differences[q] = max(differences.get(q, 0.0), max_rel_diff(a, b.detach()))
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    ours_grads = to_hf_names(shared.grads)
    assert ours_grads.keys() == hf_grads.keys(), ours_grads.keys() ^ hf_grads.keys()
    by_name = {n: max_rel_diff(g, hf_grads[n]) for n, g in ours_grads.items()}
    differences["grads"] = max(by_name.values())
    return {"differences": differences, "grads": len(hf_grads), "by_name": by_name}


def test_shared_mla_equals_transformers_deepseek_v3_run_sequence_by_sequence(one_rank):
    """transformers computes DeepseekV3's RMSNorms and router in float32 whatever the model's
    dtype, so the float64 shared run is compared at float32's tolerance: 1e-5 relative, 3x
    that for gradients (as ``verify`` allows; the worst is a q-norm weight's, about 1e-5)."""
    report = one_rank["transformers"]
    assert report["grads"] == len(report["by_name"]) > 30
    allowed = {q: 3 * FP32_RTOL if q == "grads" else FP32_RTOL for q in report["differences"]}
    worst = {q: d for q, d in report["differences"].items() if d > allowed[q]}
    assert not worst, (worst, sorted(report["by_name"].items(), key=lambda x: -x[1])[:5])
