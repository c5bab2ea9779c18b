"""A plan's flat rows split over a sequence-parallel group: equal contiguous slices, and
every packed position scored by exactly one rank (the rank holding its row)."""

import pytest
import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.row_split import split_rows


def docstring_plan(pad_to_multiple_of: int = 1):
    sequences = [torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 7, 9, 9]), torch.tensor([5, 6])]
    return build_plan(sequences, PrefixSharingConfig(min_prefix_len=1),
                      pad_to_multiple_of=pad_to_multiple_of)


def test_the_docstring_example():
    plan = docstring_plan()
    first, second = split_rows(plan, 0, 2), split_rows(plan, 1, 2)
    assert (first.row_start, first.row_stop, second.row_start, second.row_stop) == (0, 3, 3, 6)
    assert first.positions.tolist() == [0, 1, 2, 4, 5, 6, 9, 10]
    assert second.positions.tolist() == [3, 7, 8]
    assert first.rows(plan.input_ids).tolist() == [5, 6, 7]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_ranks_cover_every_row_and_position_once(size):
    plan = docstring_plan(pad_to_multiple_of=size)
    splits = [split_rows(plan, rank, size) for rank in range(size)]
    rows = torch.cat([s.rows(torch.arange(plan.num_tokens_flat)) for s in splits])
    assert rows.tolist() == list(range(plan.num_tokens_flat))
    positions = torch.cat([s.positions for s in splits]).sort().values
    assert positions.tolist() == list(range(plan.num_tokens_total))
    for s in splits:
        held = plan.kv_index[s.positions]
        assert ((held >= s.row_start) & (held < s.row_stop)).all()


def test_a_layout_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="pad_to_multiple_of=4"):
        split_rows(docstring_plan(), 0, 4)
