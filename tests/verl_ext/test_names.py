"""Patch-set names in both spellings map onto the project's sets; stated stacks are compared with
the installed one. Pure: needs no verl (the registry here is a table of names)."""

import pytest

from prefix_sharing.verl_ext.names import (
    PatchSetName, Stack, known_names, matching_names, resolve, stack_problems)

# The project's registered sets (what patchsets.registered() holds with verl 0.8.0 / 0.9.1).
REGISTERED = {f"verl{v}_{engine}": None for v in ("080", "091")
              for engine in ("mcore", "mcore_mindspeed", "fsdp")}
PY311, PY312 = (3, 11, 7), (3, 12, 1)


@pytest.mark.parametrize("name, patchsets, verl, mcore, mindspeed", [
    ("verl080_fsdp", ("verl080_fsdp",), "0.8.0", None, None),
    ("verl091_mcore", ("verl091_mcore",), "0.9.1", None, None),
    ("verl091_mcore_mindspeed", ("verl091_mcore", "verl091_mcore_mindspeed"), "0.9.1", None, None),
    ("verl091_mcore0192", ("verl091_mcore",), "0.9.1", "0.19.2", None),
    ("verl080_mcore0161", ("verl080_mcore",), "0.8.0", "0.16.1", None),
    ("verl080_mcore0161_ms0160", ("verl080_mcore", "verl080_mcore_mindspeed"), "0.8.0", "0.16.1",
     "0.16.0"),
    (" verl091_mcore0171 ", ("verl091_mcore",), "0.9.1", "0.17.1", None),
])
def test_both_spellings_resolve_to_the_projects_sets(name, patchsets, verl, mcore, mindspeed):
    assert resolve(name, REGISTERED) == PatchSetName(name.strip(), patchsets, verl, mcore,
                                                     mindspeed)


@pytest.mark.parametrize("name", [
    "verl999_fsdp",                # no patch set for that verl release
    "verl091_mcore0150",           # megatron-core release outside the tested ones
    "verl091_mcore0192_ms0160",    # MindSpeed core_r0.16.0 is written for megatron-core 0.16
    "verl091_mcore0161_ms0150",    # MindSpeed release outside the tested ones
    "verl091_fsdp0161", "verl91_mcore", "verl091_megatron", "", "verl091_mcore_ms0160",
])
def test_other_names_are_unknown(name):
    assert resolve(name, REGISTERED) is None


def test_known_names_are_every_resolvable_name_of_both_spellings():
    names = known_names(REGISTERED)
    assert all(resolve(n, REGISTERED) is not None for n in names)
    assert set(REGISTERED) <= set(names)
    assert {"verl080_mcore0161_ms0160", "verl091_mcore0192", "verl091_mcore0171",
            "verl091_mcore0182", "verl080_mcore0161"} <= set(names)
    assert "verl091_mcore0192_ms0160" not in names


def test_the_installed_stack_gets_exactly_its_names():
    cuda = Stack(verl="0.9.1", megatron_core="0.19.2", mindspeed=None, python=PY312)
    assert matching_names(REGISTERED, cuda) == ["verl091_fsdp", "verl091_mcore0192"]
    ascend = Stack(verl="0.8.0", megatron_core="0.16.1", mindspeed="0.16.0", python=PY311)
    assert matching_names(REGISTERED, ascend) == [
        "verl080_fsdp", "verl080_mcore0161", "verl080_mcore0161_ms0160"]
    untested_mcore = Stack(verl="0.9.1", megatron_core="0.15.0", mindspeed=None, python=PY311)
    assert matching_names(REGISTERED, untested_mcore) == ["verl091_fsdp"]
    assert matching_names(REGISTERED, Stack(None, "0.16.1", None, PY311)) == []
    assert matching_names(REGISTERED, Stack("0.7.1", "0.16.1", None, PY311)) == []


def test_a_stated_release_other_than_the_installed_one_is_a_difference():
    name = resolve("verl080_mcore0161_ms0160", REGISTERED)
    same = Stack(verl="0.8.0", megatron_core="0.16.1", mindspeed="0.16.0", python=PY311)
    assert stack_problems(name, same) == ([], [])
    cuda = Stack(verl="0.9.1", megatron_core="0.16.1", mindspeed=None, python=PY311)
    assert stack_problems(name, cuda) == (
        ["verl 0.8.0 (installed: 0.9.1)", "MindSpeed core_r0.16.0 (installed: none)"], [])
    newer = Stack(verl="0.9.1", megatron_core="0.19.2", mindspeed=None, python=PY312)
    assert stack_problems(resolve("verl091_mcore0171", REGISTERED), newer) == (
        ["megatron-core 0.17.1 (installed: 0.19.2)"], [])


def test_a_stack_that_cannot_exist_is_an_impossibility():
    """megatron-core 0.17+ needs Python 3.12: named on 3.11 it cannot be the installed one."""
    stack = Stack(verl="0.9.1", megatron_core="0.16.1", mindspeed=None, python=PY311)
    differences, impossible = stack_problems(resolve("verl091_mcore0192", REGISTERED), stack)
    assert differences == []
    assert impossible == ["megatron-core 0.19.2 needs Python >= 3.12; this is Python 3.11.7"]
