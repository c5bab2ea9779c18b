"""The reduction of verl 0.9's recipe table (``prefix_sharing.verl_ext.recipes``) drops no launch:
every row (every engine's) maps to exactly one combination, each combination's settings are its
rows', and the verdicts name registered refusal keys. No verl needed (the engine checks:
``test_verl_recipes``)."""

import collections

from prefix_sharing.refusals import REFUSALS
from prefix_sharing.verl_ext.recipes import (ENGINES, MODEL_TYPES, Combination, combinations,
                                             fsdp_rows, read_rows)


def test_every_row_maps_to_exactly_one_combination():
    rows = read_rows()
    found = combinations()
    mapped = collections.Counter(row.script for rows_of in found.values() for row in rows_of)
    assert set(mapped) == {row.script for row in rows} and set(mapped.values()) == {1}
    assert sum(len(r) for r in found.values()) == len(rows) == 107  # verl 0.9's launches
    assert sum(len(r) for c, r in found.items() if c.strategy in ("fsdp", "fsdp2")) == 58
    for combination, rows_of in found.items():
        assert all(Combination.of(row) == combination for row in rows_of)
    assert len({c.name for c in found}) == len(found)  # the names tell them apart


def test_only_the_fsdp_engines_rows_are_taken_and_the_unresolved_default_is_fsdp1():
    engines = collections.Counter(row.fields["engine"] for row in read_rows())
    assert len(fsdp_rows()) == sum(n for e, n in engines.items() if e.startswith("fsdp"))
    sft_default = [r for r in fsdp_rows() if r.fields["engine"] == "fsdp"]
    assert sft_default and {Combination.of(r).strategy for r in sft_default} == {"fsdp"}


def test_every_family_and_engine_is_known_and_every_verdict_a_registered_key():
    assert {r.fields["family"] for r in read_rows()} <= set(MODEL_TYPES)
    assert {r.fields["engine"] for r in read_rows()} <= set(ENGINES)
    statuses = collections.Counter()
    for combination in combinations():
        status, keys, reason = combination.verdict()
        statuses[status] += 1
        assert all(key in REFUSALS for key in keys), keys
        assert (status == "refused") == bool(keys)
    assert set(statuses) == {"served", "refused"}
    assert {c.trainer for c in combinations() if c.verdict()[0] == "served"} == {"rl", "sft"}


def test_ulysses_sizes_above_one_run_at_two_and_the_recipe_defaults_apply():
    ulysses = {int(r.fields["ulysses"]) for r in fsdp_rows()}
    assert {1, 2, 4, 8} <= ulysses
    assert {Combination.of(r).ulysses for r in fsdp_rows()} == {1, 2}
    # a script that says nothing about torch.compile gets verl's default: on
    silent = next(r for r in fsdp_rows() if "torch_compile" not in r.fields["entropy_knobs"])
    assert Combination.of(silent).torch_compile


def test_parallel_sizes_above_one_read_as_two_on_the_megatron_engine_only():
    megatron = [r for r in read_rows() if r.fields["engine"] == "megatron"]
    assert {int(r.fields["tp"]) for r in megatron} >= {1, 2, 4, 8}
    assert {Combination.of(r).tensor_parallel for r in megatron} == {1, 2}
    # an FSDP row's rollout sizes are not the engine's
    assert {Combination.of(r).tensor_parallel for r in fsdp_rows()} == {1}


def test_engines_prefix_sharing_does_not_hook_are_refused_by_name_never_served():
    for combination in combinations():
        if combination.strategy not in ("fsdp", "fsdp2", "megatron"):
            status, keys, _ = combination.verdict()
            assert status == "refused" and keys in (
                ("verl.unhooked_engine",), ("cli.unpatched_engine",))
