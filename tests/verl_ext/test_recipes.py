"""The reduction of verl 0.9's recipe table (``prefix_sharing.verl_ext.recipes``) drops no launch:
every FSDP-engine row maps to exactly one combination, each combination's settings are its rows',
and the verdicts name registered refusal keys. No verl needed (the engine checks:
``test_verl_recipes``)."""

import collections

from prefix_sharing.refusals import REFUSALS
from prefix_sharing.verl_ext.recipes import (MODEL_TYPES, Combination, combinations,
                                             fsdp_rows, read_rows)


def test_every_fsdp_row_maps_to_exactly_one_combination():
    rows = fsdp_rows()
    found = combinations()
    mapped = collections.Counter(row.script for rows_of in found.values() for row in rows_of)
    assert set(mapped) == {row.script for row in rows} and set(mapped.values()) == {1}
    assert sum(len(r) for r in found.values()) == len(rows) == 58  # verl 0.9's FSDP launches
    for combination, rows_of in found.items():
        assert all(Combination.of(row) == combination for row in rows_of)
    assert len({c.name for c in found}) == len(found)  # the names tell them apart


def test_only_the_fsdp_engines_rows_are_taken_and_the_unresolved_default_is_fsdp1():
    engines = collections.Counter(row.fields["engine"] for row in read_rows())
    assert len(fsdp_rows()) == sum(n for e, n in engines.items() if e.startswith("fsdp"))
    sft_default = [r for r in fsdp_rows() if r.fields["engine"] == "fsdp"]
    assert sft_default and {Combination.of(r).strategy for r in sft_default} == {"fsdp"}


def test_every_family_has_a_model_type_and_every_verdict_a_registered_key():
    assert {r.fields["family"] for r in fsdp_rows()} <= set(MODEL_TYPES)
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
