"""The entry point's own arguments map onto PrefixSharingConfig, and the Megatron-LM settings
it does not run exactly are refused by name."""

from __future__ import annotations

import argparse

import pytest

from prefix_sharing import PrefixSharingConfig
from prefix_sharing.errors import InputError, UnsupportedSetup

from prefix_sharing.megatron_lm.arguments import (
    SHARING_SPECS,
    add_prefix_sharing_args,
    check_megatron_args,
    sharing_config,
)


def _args(*argv: str, **megatron) -> argparse.Namespace:
    args = add_prefix_sharing_args(argparse.ArgumentParser()).parse_args(list(argv))
    defaults = dict(spec=None, context_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                    micro_batch_size=1, data_path=["/d.jsonl"])
    for key, value in {**defaults, **megatron}.items():
        setattr(args, key, value)
    return args


def test_sharing_arguments_become_the_config():
    args = _args("--prefix-sharing-mode", "off", "--prefix-sharing-min-prefix-len", "4",
                 "--prefix-sharing-min-group-size", "3", "--prefix-sharing-backend", "torch")
    assert sharing_config(args) == PrefixSharingConfig(
        mode="off", min_prefix_len=4, min_group_size=3, backend="torch")
    assert sharing_config(_args()) == PrefixSharingConfig()


def test_prompt_only_is_not_a_choice():
    with pytest.raises(SystemExit):
        _args("--prefix-sharing-mode", "prompt_only")


@pytest.mark.parametrize("kind, argv, megatron, message", [
    ("sft", [], dict(spec=["my.module", "spec"]), "--spec my.module spec"),
    ("sft", [], dict(context_parallel_size=2), "--context-parallel-size 2"),
    ("sft", [], dict(virtual_pipeline_model_parallel_size=2), "virtual pipeline"),
    ("sft", [], dict(overlap_moe_expert_parallel_comm=True), "--overlap-moe-expert-parallel-comm"),
    ("gpt", ["--prefix-sharing-data", "r.jsonl"], dict(micro_batch_size=2),
     "--micro-batch-size 2"),
])
def test_unsupported_settings_are_refused_by_name(kind, argv, megatron, message):
    with pytest.raises(UnsupportedSetup, match=message):
        check_megatron_args(_args(*argv, **megatron), kind)


@pytest.mark.parametrize("kind, argv, megatron, message", [
    ("sft", [], dict(data_path=None), "sft needs --data-path"),
    ("gpt", [], {}, "gpt needs --prefix-sharing-data"),
])
def test_a_missing_input_is_bad_input_not_a_refusal(kind, argv, megatron, message):
    with pytest.raises(InputError, match=message) as raised:
        check_megatron_args(_args(*argv, **megatron), kind)
    assert not isinstance(raised.value, UnsupportedSetup)


@pytest.mark.parametrize("spec", SHARING_SPECS)
def test_the_sharing_spec_modules_are_accepted(spec):
    check_megatron_args(_args(spec=list(spec)), "sft")
