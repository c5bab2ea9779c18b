"""A packed Megatron-LM micro-batch is split at its ``cu_seqlens``, planned, and scored with
the same masked loss sum and token count as the plain batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefix_sharing import PrefixSharingConfig

pytest.importorskip("megatron.core", reason="the Megatron-LM adapter builds megatron-core inputs")

from prefix_sharing.megatron_lm.batch import plan_packed_batch, split_packs  # noqa: E402

SHARE_ALL = PrefixSharingConfig(min_prefix_len=1)


def _packs() -> dict[str, torch.Tensor]:
    """Two packs of 16 in Megatron-LM's SFT form, four conversations opening with the same
    5-token system prompt; in the first pack the second conversation continues the first (7
    shared tokens) and runs into the pack's padding (id 0)."""
    system = [7, 8, 9, 10, 11]
    pack0 = system + [20, 21] + system + [20, 21, 30] + [0]  # 7 + 8, + 1 pad
    pack1 = system + [40, 41, 42, 43] + system + [50, 51]   # 9 + 7
    tokens = torch.tensor([pack0, pack1])
    labels = torch.cat([tokens[:, 1:], torch.zeros(2, 1, dtype=torch.long)], dim=1)
    mask = torch.ones(2, 16)
    mask[:, :4] = 0  # the system prompt predicts nothing scored
    mask[0, 14:] = 0  # the last real token and the padding
    cu = torch.tensor([[0, 7, 16] + [16] * 14, [0, 9, 16] + [16] * 14], dtype=torch.int32)
    return dict(tokens=tokens, labels=labels, loss_mask=mask, cu_seqlens=cu)


def test_packs_split_at_cu_seqlens_with_trailing_padding_in_the_last_sequence():
    batch = _packs()
    assert split_packs(batch["tokens"], batch["cu_seqlens"]) == [
        (0, 0, 7), (0, 7, 16), (1, 0, 9), (1, 9, 16)]
    assert split_packs(batch["tokens"], None) == [(0, 0, 16), (1, 0, 16)]


@pytest.mark.parametrize("cu, message", [
    ([[1, 16] + [16] * 15] * 2, "do not start at 0"),
    ([[0, 12] + [12] * 15] * 2, "reach 16"),
    ([[0, 9, 5, 16] + [16] * 13] * 2, "strictly increasing"),
])
def test_bad_cu_seqlens_are_refused(cu, message):
    with pytest.raises(ValueError, match=message):
        split_packs(torch.zeros(2, 16, dtype=torch.long), torch.tensor(cu))


@pytest.mark.parametrize("config", [SHARE_ALL, PrefixSharingConfig(mode="off")])
def test_loss_targets_give_the_plain_masked_loss_sum(config):
    batch = _packs()
    planned = plan_packed_batch(**batch, config=config, device="cpu")
    plan = planned.micro_batch.plan
    generator = torch.Generator().manual_seed(0)
    flat_logits = torch.randn(plan.input_ids.numel(), 64, generator=generator)
    # the plain logits of every token are its row's (what the model tests establish)
    spans = split_packs(batch["tokens"], batch["cu_seqlens"])
    labels = torch.cat([batch["labels"][p, a:e] for p, a, e in spans])
    mask = torch.cat([batch["loss_mask"][p, a:e] for p, a, e in spans])
    plain = (F.cross_entropy(flat_logits[plan.kv_index], labels, reduction="none") * mask).sum()
    t = planned.targets
    shared = (F.cross_entropy(flat_logits[t.rows], t.labels, reduction="none") * t.weights).sum()
    torch.testing.assert_close(shared, plain, rtol=1e-6, atol=0)
    assert int(t.num_tokens) == int(batch["loss_mask"].sum())
    assert planned.tokens_total == 32
    if config.enabled:  # the first conversation inside the second, the prompt across packs
        assert planned.tokens_computed == 32 - 7 - 5 - 5 and len(t.rows) < int(t.num_tokens)
    else:
        assert planned.tokens_computed == 32


def test_mtp_depths_are_planned_only_where_every_scored_label_is_the_next_token():
    """The MTP depths read each sequence's own later tokens: a scored label across a
    conversation's end (each pack's first conversation scores its last position, whose label
    is the next conversation's first token) is refused; with no last position scored, the
    depths plan."""
    from prefix_sharing.errors import InputError

    batch = _packs()
    with pytest.raises(InputError, match="sequence 0 scores a label"):
        plan_packed_batch(**batch, config=SHARE_ALL, device="cpu", mtp_num_layers=1)
    for pack, last in ((0, 6), (1, 8), (1, 15)):  # every conversation's last position
        batch["loss_mask"][pack, last] = 0
    planned = plan_packed_batch(**batch, config=SHARE_ALL, device="cpu", mtp_num_layers=2)
    depths = planned.micro_batch.packed_seq_params.mtp
    assert len(depths) == 2
    # the depth-1 weight of a position is the loss mask one further along its sequence
    assert depths[0].weights[:7].tolist() == batch["loss_mask"][0, 1:7].tolist() + [0.0]
