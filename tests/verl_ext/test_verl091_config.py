"""The ``prefix_grouper`` block through verl 0.9.1's own config conversion, and the engine
settings sharing refuses."""

from types import SimpleNamespace

import pytest

from tests.verl_ext._requires import require_verl

require_verl("0.9.1")

import prefix_sharing  # noqa: E402,F401  (activates the patches)
from prefix_sharing import PrefixSharingConfig  # noqa: E402
from prefix_sharing.verl_ext.mcore import PrefixSharingSetupError  # noqa: E402
from tests.verl_ext._engine import actor_config  # noqa: E402
from tests.verl_ext._overlays import OVERLAY_MODES, overlay_configs  # noqa: E402


def test_the_issue_yaml_reaches_the_engine_config():
    config = actor_config({"mode": "arbitrary_prefix", "min_prefix_len": 8, "min_group_size": 2})
    assert config.engine.prefix_sharing == PrefixSharingConfig("arbitrary_prefix", 8, 2)


def test_bare_use_prefix_grouper_means_prompt_only_and_absent_means_off():
    assert actor_config({}).engine.prefix_sharing.mode == "prompt_only"
    assert actor_config(None).engine.prefix_sharing.mode == "off"


def test_a_typo_in_the_block_fails_at_config_time():
    with pytest.raises(Exception, match=r"unknown key\(s\) \['min_prefix'\]"):
        actor_config({"mode": "arbitrary_prefix", "min_prefix": 8})


@pytest.mark.parametrize("setting, message", [
    (dict(dynamic_context_parallel=True), "dynamic_context_parallel=True"),
    (dict(use_fused_kernels=True, context_parallel_size=2),
     "use_fused_kernels=True with context_parallel_size=2"),
    (dict(context_parallel_size=2, router_replay=SimpleNamespace(mode="R2")),
     "router_replay.mode='R2' with context_parallel_size=2"),
])
def test_settings_sharing_cannot_honour_raise_one_clear_error(setting, message):
    from prefix_sharing.verl_ext.engine import registered_engine

    config = actor_config({"mode": "arbitrary_prefix"})
    for key, value in setting.items():
        object.__setattr__(config.engine, key, value)
    engine_cls = registered_engine("language_model", "megatron")
    model_config = SimpleNamespace(mtp=SimpleNamespace(enable=False, enable_train=False))
    with pytest.raises(PrefixSharingSetupError, match=message):
        engine_cls(model_config, config.engine, config.optim, config.checkpoint)


@pytest.mark.parametrize("overlay, mode", OVERLAY_MODES)
def test_each_overlay_configures_the_actor_and_the_reference_model(overlay, mode):
    merged, configs = overlay_configs(overlay, dict(
        _target_="verl.workers.config.McoreActorConfig", rollout_n=2, ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        megatron={"_target_": "verl.workers.config.McoreEngineConfig"},
    ))
    assert "external_lib" not in merged.actor_rollout_ref.model  # the plugin loads it on 0.9.1
    for section, config in configs.items():
        assert config.engine.prefix_sharing.mode == mode, section
