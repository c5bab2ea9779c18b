"""A trajectory file becomes packs in Megatron-LM's SFT form, one per group-keeping
micro-batch, scored on responses; sharing off sees the same packs."""

from __future__ import annotations

import json

import pytest
import torch

from prefix_sharing import PrefixSharingConfig, build_plan

pytest.importorskip("megatron.core", reason="the Megatron-LM adapter imports megatron-core")

from prefix_sharing.megatron_lm.batch import split_packs  # noqa: E402
from prefix_sharing.megatron_lm.datasets import JsonlConversations, TrajectoryPacks  # noqa: E402
from tests.megatron_lm._data import write_trajectories  # noqa: E402


def test_a_tree_stays_in_one_pack_under_a_computed_token_budget(tmp_path):
    path = write_trajectories(tmp_path / "tree.jsonl", tree=True, trees=3)
    packs = TrajectoryPacks(path, 200, PrefixSharingConfig())
    assert len(packs) == 3 and packs.split.groups_split == 0
    for index in range(len(packs)):
        item = packs[index]
        spans = split_packs(item["tokens"][None], item["cu_seqlens"][None])
        assert len(spans) == 4  # the tree's four leaves
        sequences = [item["tokens"][a:e] for _, a, e in spans]
        plan = build_plan(sequences, PrefixSharingConfig())
        assert plan.num_tokens_unique <= 200 < plan.num_tokens_total
        for _, a, e in spans:  # labels are the next token; the prompt (40) predicts nothing
            assert torch.equal(item["labels"][a:e - 1], item["tokens"][a + 1:e])
            assert item["loss_mask"][a:a + 39].sum() == 0 and item["loss_mask"][e - 1] == 0
            assert item["loss_mask"][a + 39:e - 1].eq(1).all()
            assert torch.equal(item["position_ids"][a:e], torch.arange(e - a))
    assert packs[len(packs)].keys() == packs[0].keys()  # indices wrap around


def test_sharing_off_reads_the_same_packs(tmp_path):
    path = write_trajectories(tmp_path / "tree.jsonl", tree=True, trees=3)
    shared = TrajectoryPacks(path, 200, PrefixSharingConfig())
    off = TrajectoryPacks(path, 200, PrefixSharingConfig(mode="off"))
    assert shared.split.micro_batches == off.split.micro_batches


def test_input_ids_only_scores_every_prediction(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"input_ids": [3, 4, 5, 6]}) + "\n")
    item = TrajectoryPacks(path, 16, PrefixSharingConfig())[0]
    assert item["loss_mask"].tolist() == [1, 1, 1, 0]
    assert item["cu_seqlens"].tolist() == [0, 4, 4, 4, 4]


def test_conversations_file_needs_messages(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "x"}]}) + "\n\n")
    assert len(JsonlConversations(path)) == 1
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="c.jsonl:1: expected an object with a 'messages' list"):
        JsonlConversations(path)
