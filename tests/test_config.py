"""PrefixSharingConfig: defaults, validation, and the verl actor-config mapping."""

import dataclasses
from types import SimpleNamespace

import pytest

from prefix_sharing import PrefixSharingConfig


def test_defaults_share_arbitrary_prefixes_of_eight_tokens():
    config = PrefixSharingConfig()
    assert (config.mode, config.min_prefix_len, config.min_group_size, config.backend) == (
        "arbitrary_prefix", 8, 2, "auto",
    )
    assert config.enabled and not PrefixSharingConfig(mode="off").enabled


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("mode", "trie", "mode must be one of 'arbitrary_prefix', 'prompt_only', 'off'; got 'trie'"),
        ("backend", "cuda", "backend must be one of 'auto', 'torch', 'flash_attn', 'te', 'npu'"),
        ("min_prefix_len", 0, "min_prefix_len must be an integer >= 1; got 0"),
        ("min_prefix_len", 2.5, "min_prefix_len must be an integer >= 1; got 2.5"),
        ("min_prefix_len", True, "min_prefix_len must be an integer >= 1; got True"),
        ("min_group_size", 1, "min_group_size must be an integer >= 2; got 1"),
        ("cross_micro_batch", 1, "cross_micro_batch must be true or false; got 1"),
        ("self_check", "true", "self_check must be true or false; got 'true'"),
        ("self_check", 1, "self_check must be true or false; got 1"),
    ],
)
def test_invalid_values_name_the_field_and_what_is_allowed(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PrefixSharingConfig(**{field: value})


def test_cross_micro_batch_is_off_by_default_and_needs_arbitrary_prefixes():
    assert not PrefixSharingConfig().cross_micro_batch
    assert PrefixSharingConfig(mode="off", cross_micro_batch=True).cross_micro_batch
    with pytest.raises(ValueError, match="cross_micro_batch=True plans with mode='arbitrary_prefix'"):
        PrefixSharingConfig(mode="prompt_only", cross_micro_batch=True)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PrefixSharingConfig().mode = "off"


class TestFromVerl:
    def test_flag_alone_means_prompt_only_as_in_verl(self):
        assert PrefixSharingConfig.from_verl({"use_prefix_grouper": True}).mode == "prompt_only"

    def test_flag_off_or_absent_means_off(self):
        assert PrefixSharingConfig.from_verl({"use_prefix_grouper": False}).mode == "off"
        assert PrefixSharingConfig.from_verl({}).mode == "off"

    def test_prefix_grouper_block_sets_every_field(self):
        actor = {
            "use_prefix_grouper": True,
            "prefix_grouper": {"mode": "arbitrary_prefix", "min_prefix_len": 4,
                               "min_group_size": 3, "backend": "torch"},
        }
        assert PrefixSharingConfig.from_verl(actor) == PrefixSharingConfig(
            mode="arbitrary_prefix", min_prefix_len=4, min_group_size=3, backend="torch"
        )

    def test_block_without_mode_keeps_the_verl_default(self):
        actor = {"use_prefix_grouper": True, "prefix_grouper": {"min_prefix_len": 16}}
        assert PrefixSharingConfig.from_verl(actor) == PrefixSharingConfig(
            mode="prompt_only", min_prefix_len=16
        )

    def test_disabled_flag_wins_over_the_block(self):
        actor = {"use_prefix_grouper": False, "prefix_grouper": {"mode": "arbitrary_prefix"}}
        assert PrefixSharingConfig.from_verl(actor).mode == "off"

    def test_attribute_style_and_whole_trainer_configs(self):
        actor = SimpleNamespace(use_prefix_grouper=True,
                                prefix_grouper=SimpleNamespace(mode="arbitrary_prefix"))
        assert PrefixSharingConfig.from_verl(actor).mode == "arbitrary_prefix"
        trainer = {"actor_rollout_ref": {"actor": {"use_prefix_grouper": True}}}
        assert PrefixSharingConfig.from_verl(trainer).mode == "prompt_only"

    def test_self_check_is_off_unless_the_block_turns_it_on(self):
        assert not PrefixSharingConfig.from_verl({"use_prefix_grouper": True}).self_check
        actor = {"use_prefix_grouper": True, "prefix_grouper": {"self_check": True}}
        assert PrefixSharingConfig.from_verl(actor) == PrefixSharingConfig(
            mode="prompt_only", self_check=True)
        with pytest.raises(ValueError, match="self_check must be true or false"):
            PrefixSharingConfig.from_verl({"use_prefix_grouper": True,
                                           "prefix_grouper": {"self_check": "yes"}})

    def test_unknown_key_is_named(self):
        with pytest.raises(ValueError, match=r"unknown key\(s\) \['min_len'\]"):
            PrefixSharingConfig.from_verl({"use_prefix_grouper": True,
                                           "prefix_grouper": {"min_len": 4}})

    def test_invalid_values_are_reported_like_the_constructor(self):
        with pytest.raises(ValueError, match="mode must be one of"):
            PrefixSharingConfig.from_verl({"use_prefix_grouper": True,
                                           "prefix_grouper": {"mode": "tree"}})
        with pytest.raises(ValueError, match="use_prefix_grouper must be true or false"):
            PrefixSharingConfig.from_verl({"use_prefix_grouper": "yes"})
