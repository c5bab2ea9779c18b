"""The memo of plan-derived state: built once per plan, built again for another plan, freed with
the plan, and the owner's own equality and hashing untouched."""

import dataclasses
import gc
import weakref

import pytest
import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.attention.window import windowed_keys
from prefix_sharing.fsdp_compat.response_rows import response_rows
from prefix_sharing.memo import derived, derived_property
from prefix_sharing.recurrent import recurrence_schedule
from prefix_sharing.recurrent.gated_delta import forest_layout

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
SEQUENCES = [[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]]


class Owner:
    """A plain weak-referenceable owner."""


@dataclasses.dataclass(frozen=True)
class ValueEqual:
    """A frozen dataclass with value equality and hashing (unlike the plan's identity)."""

    n: int

    @derived_property
    def doubled(self) -> torch.Tensor:
        return torch.tensor([2 * self.n])


@dataclasses.dataclass
class Unhashable:
    n: int  # eq=True, not frozen: __hash__ is None


def _counting_build():
    calls = []

    def build(owner, *args):
        calls.append(args)
        return torch.tensor(list(args) or [0])

    return build, calls


def test_built_once_per_owner_and_arguments():
    build, calls = _counting_build()
    owner = Owner()
    first = derived(owner, build, 3)
    assert derived(owner, build, 3) is first
    assert calls == [(3,)]
    assert derived(owner, build, 4) is not first  # other arguments: another value
    assert calls == [(3,), (4,)]


def test_a_second_owner_builds_again():
    build, calls = _counting_build()
    one, two = Owner(), Owner()
    assert derived(one, build, 1) is not derived(two, build, 1)
    assert calls == [(1,), (1,)]


def test_two_builders_do_not_share_a_value():
    owner = Owner()
    first, _ = _counting_build()
    second, _ = _counting_build()
    assert derived(owner, first, 1) is not derived(owner, second, 1)


def test_the_value_is_freed_with_its_owner():
    build, calls = _counting_build()
    owner = Owner()
    owner_ref, value_ref = weakref.ref(owner), weakref.ref(derived(owner, build, 1))
    gc.collect()
    assert value_ref() is not None  # the owner alive keeps its value
    del owner
    gc.collect()
    assert owner_ref() is None and value_ref() is None


def test_equal_owners_keep_their_equality_and_their_own_values():
    a, b = ValueEqual(2), ValueEqual(2)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.doubled is a.doubled
    assert a.doubled is not b.doubled  # keyed on the object, not on its value
    assert a.doubled.tolist() == [4]
    assert "doubled" not in vars(a)  # nothing written into the frozen instance
    build, calls = _counting_build()
    unhashable = Unhashable(1)
    assert derived(unhashable, build, 1) is derived(unhashable, build, 1)
    assert calls == [(1,)]


def test_every_plan_derived_value_is_built_once_per_plan():
    plan = build_plan(SEQUENCES, EVERY_PREFIX)
    for name in ("cu_seqlens", "token_ids", "next_token_ids", "is_last_token"):
        assert getattr(plan, name) is getattr(plan, name), name
        assert name not in vars(plan), name  # the frozen plan holds no memo state
    assert windowed_keys(plan, 2) is windowed_keys(plan, 2)
    assert windowed_keys(plan, 2) is not windowed_keys(plan, 3)
    schedule = recurrence_schedule(plan)
    assert recurrence_schedule(plan) is schedule
    assert schedule.conv_predecessors(4) is schedule.conv_predecessors(4)
    device = plan.kv_index.device
    assert forest_layout(schedule, device) is forest_layout(schedule, device)
    rows = response_rows(plan, [2, 3, 1])
    assert rows.next_token_ids is rows.next_token_ids and rows.is_last_token is rows.is_last_token
    # the plan keeps its identity equality and hashing
    moved = plan.to("cpu")
    assert moved != plan and plan == plan and len({plan, moved}) == 2
    # another plan (the same layout, moved) builds its own values
    assert moved.token_ids is not plan.token_ids
    assert torch.equal(moved.token_ids, plan.token_ids)
    assert recurrence_schedule(moved) is not schedule
    assert windowed_keys(moved, 2) is not windowed_keys(plan, 2)


def test_plain_batch_view_is_built_once_per_plan():
    pytest.importorskip("megatron.core")
    from prefix_sharing.megatron_ext.plain_batch_view import plain_batch_view

    plan = build_plan(SEQUENCES, EVERY_PREFIX)
    view = plain_batch_view(plan, per_sequence=True)
    assert plain_batch_view(plan, per_sequence=True) is view
    assert plain_batch_view(plan, per_sequence=False) is not view
    assert plain_batch_view(plan.to("cpu"), per_sequence=True) is not view


def test_a_plans_derived_values_die_with_the_plan():
    plan = build_plan(SEQUENCES, EVERY_PREFIX)
    schedule = recurrence_schedule(plan)
    refs = [weakref.ref(x) for x in (
        plan, plan.token_ids, windowed_keys(plan, 2), schedule, schedule.conv_predecessors(4),
        forest_layout(schedule, plan.kv_index.device))]
    del plan, schedule
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
