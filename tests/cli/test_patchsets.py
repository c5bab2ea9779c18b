"""``prefix-sharing patchsets``: the names for the installed stack, as text and as JSON."""

import json

import pytest

from prefix_sharing.cli import main
from prefix_sharing.cli import patchsets as command
from prefix_sharing.verl_ext.names import Stack


@pytest.fixture
def stack(monkeypatch):
    def use(stack: Stack) -> None:
        monkeypatch.setattr(command, "installed_stack", lambda: stack)
    return use


def test_lists_the_names_that_state_the_installed_stack(capsys, stack):
    stack(Stack(verl="0.8.0", megatron_core="0.16.1", mindspeed="0.16.0", python=(3, 11, 7)))
    assert main(["patchsets"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "installed: verl 0.8.0, megatron-core 0.16.1, MindSpeed 0.16.0, Python 3.11.7"
    assert [line.split() for line in out[2:]] == [
        ["verl080_fsdp", "applies", "verl080_fsdp"],
        ["verl080_mcore0161", "applies", "verl080_mcore"],
        ["verl080_mcore0161_ms0160", "applies", "verl080_mcore", "+", "verl080_mcore_mindspeed"],
    ]


def test_json_is_one_object(capsys, stack):
    stack(Stack(verl="0.9.1", megatron_core="0.19.2", mindspeed=None, python=(3, 12, 1)))
    assert main(["patchsets", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "installed": {"verl": "0.9.1", "megatron_core": "0.19.2", "mindspeed": None,
                      "python": "3.12.1"},
        "patchsets": {"verl091_fsdp": ["verl091_fsdp"], "verl091_mcore0192": ["verl091_mcore"]},
    }


def test_without_a_supported_verl_it_says_so_and_all_lists_every_name(capsys, stack):
    stack(Stack(verl=None, megatron_core="0.16.1", mindspeed=None, python=(3, 11, 7)))
    assert main(["patchsets"]) == 0
    out = capsys.readouterr().out
    assert "no patch set for this stack (verl 0.8.0, 0.9.1 are supported)" in out
    assert main(["patchsets", "--all", "--json"]) == 0
    names = json.loads(capsys.readouterr().out)["patchsets"]
    assert names["verl080_mcore0161_ms0160"] == ["verl080_mcore", "verl080_mcore_mindspeed"]
    assert names["verl091_mcore"] == ["verl091_mcore"]
