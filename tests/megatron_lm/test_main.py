"""``python -m prefix_sharing.megatron_lm``: the usage without a kind, and one message naming
what to use where megatron.training (megatron-core >= 0.17) is missing."""

from __future__ import annotations

import sys

import pytest

from prefix_sharing.megatron_lm.main import main


@pytest.mark.parametrize("argv", [[], ["--num-layers", "2"], ["dpo"]])
def test_without_a_kind_it_prints_the_usage(argv):
    with pytest.raises(SystemExit, match=r"usage: python -m prefix_sharing.megatron_lm \{gpt,sft\}"):
        main(argv)


def test_without_megatron_training_it_says_what_to_use(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setitem(sys.modules, "megatron.training.argument_utils", None)  # import fails
    with pytest.raises(SystemExit, match="megatron-core >= 0.17 .* core_r0.16.0 checkout"):
        main(["sft", "--num-layers", "2"])
