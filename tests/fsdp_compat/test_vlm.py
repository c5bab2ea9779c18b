"""Vision-language checkpoints (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE)
through the sharing forward equal transformers' own model run sequence by sequence (eager,
float64: within 1e-5 relative; the rotary tables are float32 in transformers, so the runs agree
to ~1e-6, not 1e-15): logits, log-probs, entropy, loss and every gradient, the vision tower's
included. Text-only batches, a GRPO group sharing its image, token-identical prompts over
different images, and a multi-turn tree with images in the shared turns and in the tails."""

from __future__ import annotations

import pytest
import torch
import transformers

from prefix_sharing.equivalence import within_tolerance
from prefix_sharing.fsdp_compat import VLM_FAMILIES, shared_forward
from prefix_sharing.fsdp_compat.vlm import MIN_TRANSFORMERS
from prefix_sharing.planner import build_plan
from prefix_sharing.workloads import make_workload

from ._models import EVERY_PREFIX
from ._vlm import TEXT_VOCAB, Batch, compare, vlm_models

if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < MIN_TRANSFORMERS:
    pytest.skip(f"vision-language models need transformers >= {MIN_TRANSFORMERS} (their "
                "refusal below it: test_models.py)", allow_module_level=True)


def _passes(comparison) -> bool:
    return all(within_tolerance(comparison).values())


def _text_batch(config, workload: str) -> Batch:
    batch = Batch(config)
    batch.sequences = make_workload(workload, vocab_size=TEXT_VOCAB).sequences
    batch.mm = [None] * len(batch.sequences)
    return batch


@pytest.mark.parametrize("family, workload", [(f, "tree") for f in VLM_FAMILIES] + [
    ("qwen2_5_vl", "grpo"), ("qwen2_5_vl", "none"), ("qwen3_5", "grpo")])
def test_text_only_batches(family, workload):
    plain, shared = vlm_models(family)
    comparison = compare(plain, shared, _text_batch(plain.config, workload))
    assert _passes(comparison), comparison.max_rel_diff


def test_the_vision_tower_keeps_its_attention():
    plain, shared = vlm_models("qwen2_5_vl")
    assert shared.config.text_config._attn_implementation == "prefix_sharing"
    assert shared.config.vision_config._attn_implementation == "eager"


def grpo_image_batch(config) -> Batch:
    """One prompt with one image, four responses."""
    batch = Batch(config)
    image = batch.image()
    prompt = torch.cat([batch.text(5), batch.placeholders(image), batch.text(3)])
    for k in range(4):
        batch.add([prompt, batch.text(3 + k)], [image])
    return batch


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_group_shares_its_image(family):
    plain, shared = vlm_models(family)
    batch = grpo_image_batch(plain.config)
    out = shared_forward(shared, batch.sequences, EVERY_PREFIX, multi_modal_inputs=batch.mm)
    prompt_len = 5 + 6 + 3
    assert sorted(out.plan.prefix_lens) == [0] + [prompt_len] * 3
    assert (out.images.images_total, out.images.images_computed) == (4, 1)
    metrics = out.metrics()
    assert metrics["prefix_sharing/vision_images_total"] == 4
    assert metrics["prefix_sharing/vision_images_computed"] == 1
    assert metrics["prefix_sharing/vision_tokens_total"] == 4 * 4  # 4 placeholders per image
    assert metrics["prefix_sharing/vision_tokens_computed"] == 4
    assert metrics["prefix_sharing/tokens_total"] == out.plan.num_tokens_total
    comparison = compare(plain, shared, batch)
    assert _passes(comparison), comparison.max_rel_diff


def two_groups(config) -> tuple[Batch, list[dict]]:
    """Two groups with token-identical prompts over different images (of one grid), and the
    first group's images for every sequence (what sharing them would assume)."""
    batch = Batch(config)
    images = [batch.image(), batch.image()]
    prompt = torch.cat([batch.text(5), batch.placeholders(images[0]), batch.text(3)])
    for image in images:
        for k in range(2):
            batch.add([prompt, batch.text(3 + k)], [image])
    return batch, [batch.mm[0]] * len(batch.sequences)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_token_identical_prompts_over_different_images_do_not_share(family):
    plain, shared = vlm_models(family)
    batch, forced = two_groups(plain.config)
    out = shared_forward(shared, batch.sequences, EVERY_PREFIX, multi_modal_inputs=batch.mm)
    # within a group: the whole prompt; across: the text before the first image token
    assert sorted(out.plan.prefix_lens) == [0, 6, 14, 14]
    assert out.images.images_computed == 2
    comparison = compare(plain, shared, batch)
    assert _passes(comparison), comparison.max_rel_diff
    # the control: sharing the first group's image with the second group must fail
    control = compare(plain, shared, batch, shared_mm=forced)
    assert not _passes(control), control.max_rel_diff


def multi_turn_tree(config) -> Batch:
    """A shared first turn with a screenshot; branches whose second turn holds the same or a
    new screenshot (in the tail), one a strict prefix, one a duplicate, one text-only."""
    batch = Batch(config)
    first, second, third = batch.image(), batch.image(4, 6), batch.image()
    turn1 = torch.cat([batch.text(4), batch.placeholders(first), batch.text(3)])
    lead, after = batch.text(2), batch.text(2)
    turn2 = torch.cat([lead, batch.placeholders(second), after])
    turn2b = torch.cat([lead, batch.placeholders(third), after])
    reply = batch.text(3)
    batch.add([turn1, turn2, reply], [first, second])
    batch.add([turn1, turn2, batch.text(4)], [first, second])  # shares both screenshots
    batch.add([turn1, turn2b, reply], [first, third])  # a new screenshot in its tail
    batch.add([turn1, turn2], [first, second])  # a strict prefix
    batch.add([turn1, turn2, reply], [first, second])  # a duplicate
    batch.add([batch.text(9)], [])
    return batch


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_a_multi_turn_tree_with_screenshots(family):
    plain, shared = vlm_models(family)
    batch = multi_turn_tree(plain.config)
    out = shared_forward(shared, batch.sequences, EVERY_PREFIX, multi_modal_inputs=batch.mm)
    assert (out.images.images_total, out.images.images_computed) == (10, 3)
    # placeholders: 4 + 6 per two-screenshot sequence, 4 + 4 on the new-screenshot branch;
    # computed: the first screenshot, the second, the new one
    assert out.metrics()["prefix_sharing/vision_tokens_total"] == 4 * 10 + 8
    assert out.metrics()["prefix_sharing/vision_tokens_computed"] == 4 + 6 + 4
    turn1, turn2 = 4 + 6 + 3, 2 + 8 + 2
    # one provider; the other reply: both screenshots; the new screenshot's branch: up to its
    # vision start; the strict prefix and the duplicate: all of theirs; the text-only: nothing
    assert out.plan.prefix_lens[2] == turn1 + 3
    assert sorted(out.plan.prefix_lens) == sorted(
        [0, turn1 + turn2, turn1 + 3, turn1 + turn2, turn1 + turn2 + 3, 0])
    comparison = compare(plain, shared, batch)
    assert _passes(comparison), comparison.max_rel_diff


def test_prompt_only_groups_stop_at_a_different_image():
    plain, shared = vlm_models("qwen2_5_vl")
    batch, _ = two_groups(plain.config)
    config = EVERY_PREFIX.__class__(mode="prompt_only", min_prefix_len=1)
    groups = [(14, [0, 1, 2, 3])]  # one group over both images: shares the text before them
    out = shared_forward(shared, batch.sequences, config, groups=groups,
                         multi_modal_inputs=batch.mm)
    assert out.plan.prefix_lens == (0, 14, 6, 6)
    weights_free = build_plan(batch.sequences, config, groups=groups)  # tokens alone
    assert weights_free.prefix_lens == (0, 14, 14, 14)


def test_response_rows_with_images():
    """``response_starts`` on an image batch: the LM head on the response rows only gives the
    full head's response log-probs, entropy and every gradient (vision tower included)."""
    import copy

    _, full = vlm_models("qwen3_vl")
    kept = copy.deepcopy(full)
    batch = grpo_image_batch(full.config)
    starts = [5 + 6 + 3] * len(batch.sequences)

    def loss(log_probs, entropy):
        return -(torch.linspace(0.5, 1.5, log_probs.numel(), dtype=log_probs.dtype)
                 * log_probs).mean() - 0.01 * entropy.mean()

    ref = shared_forward(full, batch.sequences, EVERY_PREFIX, multi_modal_inputs=batch.mm)
    spans = [slice(s - 1, n) for s, n in zip(starts, ref.plan.seq_lens)]
    ref_lp = torch.cat([x[sp] for x, sp in zip(ref.plan.split(ref.stats.log_probs), spans)])
    ref_ent = torch.cat([x[sp] for x, sp in zip(ref.plan.split(ref.stats.entropy), spans)])
    loss(ref_lp, ref_ent).backward()
    out = shared_forward(kept, batch.sequences, EVERY_PREFIX, multi_modal_inputs=batch.mm,
                         response_starts=starts)
    loss(out.stats.log_probs, out.stats.entropy).backward()
    assert out.logits.size(0) == out.response.num_tokens_flat < ref.plan.num_tokens_flat
    torch.testing.assert_close(out.stats.log_probs, ref_lp, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out.stats.entropy, ref_ent, rtol=1e-9, atol=1e-10)
    grads = 0
    for (name, p), q in zip(kept.named_parameters(), full.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
            grads += name.startswith("model.visual")
    assert grads > 0  # the vision tower's gradients were compared


def test_the_mrope_rows_matter(monkeypatch):
    """A control: with each token's index in all three rows (the text-only rule) instead of
    get_rope_index's, the image batch no longer matches transformers."""
    from prefix_sharing.fsdp_compat import mrope

    plain, shared = vlm_models("qwen2_5_vl")
    batch = multi_turn_tree(plain.config)
    assert _passes(compare(plain, shared, batch))
    monkeypatch.setattr(mrope, "sequence_positions", lambda model, sequences, images: [
        torch.arange(s.numel())[None].repeat(3, 1) for s in sequences])
    control = compare(plain, shared, batch)
    assert not _passes(control), control.max_rel_diff


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_the_router_loss_of_an_image_batch_equals_the_plain_forward(family):
    """Every token routed once per sequence holding it, image tokens included."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from prefix_sharing.fsdp_compat.plain_kernels import plain_gdn_kernel

    plain, shared = vlm_models(family)
    batch = grpo_image_batch(plain.config)
    text = plain.config.text_config
    router_logits = []
    with plain_gdn_kernel(plain):  # Qwen3.5's recurrence in float64, as in plain_vlm_run
        for seq, mm in zip(batch.sequences, batch.mm):
            types = (seq == plain.config.image_token_id).to(torch.int32)[None]
            router_logits.append(plain(input_ids=seq[None], mm_token_type_ids=types,
                                       use_cache=False, output_router_logits=True,
                                       **mm).router_logits)
    per_layer = tuple(torch.cat(layer) for layer in zip(*router_logits))
    expected = load_balancing_loss_func(per_layer, text.num_experts, text.num_experts_per_tok)
    out = shared_forward(shared, batch.sequences, EVERY_PREFIX, multi_modal_inputs=batch.mm)
    assert out.plan.has_sharing
    # within the float64 rule (1e-5): the float32 rotary tables move it by ~1e-8
    torch.testing.assert_close(out.aux_loss, expected, rtol=1e-5, atol=0)
    expected.backward()
    out.aux_loss.backward()
    routers = [(n, p.grad) for n, p in plain.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers and all(grad is not None for _, grad in routers)
    shared_grads = dict(shared.named_parameters())
    for name, grad in routers:  # the float32 rotary tables: ~1e-6 apart, as the other outputs
        torch.testing.assert_close(shared_grads[name].grad, grad, rtol=1e-5,
                                   atol=1e-5 * float(grad.abs().max()), msg=name)
