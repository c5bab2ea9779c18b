"""The forest layout of the torch rule: every flat row in exactly one chunk slot, a piece's
chunks right after its parent's, the scan as long as the longest root-to-leaf path in chunks;
and the one-pass rule equals the rule run piece by piece from the parents' final states."""

import pytest
import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.recurrent import recurrence_schedule
from prefix_sharing.recurrent.forest import ForestLayout, gated_delta_rule_forest
from prefix_sharing.recurrent.torch_kernels import gated_delta_rule_recurrent
from prefix_sharing.workloads import make_workload

from .test_gated_delta import flat_inputs

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)


def _tree_schedule():
    return recurrence_schedule(build_plan(make_workload("tree", vocab_size=64, seed=1).sequences,
                                          EVERY_PREFIX))


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_layout_places_every_row_once_and_follows_the_forest(chunk_size):
    schedule = _tree_schedule()
    pieces = schedule.pieces
    layout = ForestLayout(pieces, schedule.num_rows, chunk_size, torch.device("cpu"))
    slots = layout.chunk_rows.flatten()
    assert sorted(slots[layout.keep].tolist()) == list(range(schedule.num_rows))
    assert (slots == schedule.num_rows).sum() == slots.numel() - schedule.num_rows  # pad slots
    chunks = [-(-(p.end - p.start) // layout.size) for p in pieces]

    def path_chunks(i):
        return chunks[i] + (path_chunks(pieces[i].parent) if pieces[i].parent >= 0 else 0)

    assert len(layout.sources) == max(path_chunks(i) for i in range(len(pieces)))
    assert layout.num_roots == sum(p.parent < 0 for p in pieces)
    assert any(source is not None for source in layout.sources)  # branches change the lanes


def test_one_pass_equals_the_rule_piece_by_piece_from_the_parents_states():
    schedule = _tree_schedule()
    x = flat_inputs(schedule.num_rows)
    layout = ForestLayout(schedule.pieces, schedule.num_rows, 4, torch.device("cpu"))
    out = gated_delta_rule_forest(*x.values(), layout, use_qk_l2norm_in_kernel=True)
    finals, ref = {}, torch.zeros_like(out)
    for i in sorted(range(len(schedule.pieces)), key=lambda i: schedule.pieces[i].depth):
        p = schedule.pieces[i]
        h0 = None if p.parent < 0 else finals[p.parent]
        piece_out, finals[i] = gated_delta_rule_recurrent(
            *(t[p.start:p.end] for t in x.values()), initial_state=h0,
            use_qk_l2norm_in_kernel=True)
        ref[p.start:p.end] = piece_out
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
