"""verl's Megatron engine refuses a Gated DeltaNet hybrid (Qwen3.5, Qwen3-Next) with sharing on
where megatron-core cannot carry its state (every release but 0.19.2; the verl environments
have 0.16.1), at construction, naming the release that works; with sharing off, or for an
attention-only model, nothing is refused. The engine is built the way verl's worker builds it:
``McoreActorConfig`` through verl's config conversion (``prefix_grouper`` in it), then the
registered language-model engine with the model's HF config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.verl_ext._requires import require_verl

require_verl(("0.9.1", "0.8.0"))

import transformers  # noqa: E402

from prefix_sharing.megatron_ext.stock_gdn import serves_gated_delta_net  # noqa: E402
from prefix_sharing.verl_ext.hybrid import hybrid_release_problem, is_gdn_hybrid  # noqa: E402
from prefix_sharing.verl_ext.mcore import PrefixSharingSetupError  # noqa: E402
from tests.verl_ext._compare import MODES  # noqa: E402
from tests.verl_ext._engine import actor_config  # noqa: E402

HYBRID_CONFIGS = [name for name in ("Qwen3NextConfig", "Qwen3_5TextConfig",
                                    "Qwen3_5MoeTextConfig", "Qwen3_5Config")
                  if hasattr(transformers, name)]


def model_config(hf_config):
    """What the engine reads of verl's ``HFModelConfig`` before building anything."""
    return SimpleNamespace(hf_config=hf_config, tokenizer=SimpleNamespace(pad_token_id=0),
                           mtp=SimpleNamespace(enable=False, enable_train=False),
                           model_type="language_model")


def engine_class():
    from prefix_sharing.verl_ext.engine import registered_engine

    return registered_engine("language_model", "megatron")


@pytest.mark.skipif(serves_gated_delta_net(), reason="megatron-core 0.19.2 serves GDN hybrids")
@pytest.mark.parametrize("config_name", HYBRID_CONFIGS)
def test_a_hybrid_is_refused_at_construction_naming_megatron_core_0192(config_name):
    hf_config = getattr(transformers, config_name)()
    config = actor_config(MODES["arbitrary_prefix"])
    with pytest.raises(PrefixSharingSetupError, match=r"megatron-core==0\.19\.2") as refused:
        engine_class()(model_config(hf_config), config.engine, config.optim, config.checkpoint)
    message = str(refused.value)
    assert hf_config.model_type in message and "Gated DeltaNet" in message
    assert "strategy: fsdp2" in message  # the engine that serves it
    # a vision-language checkpoint (Qwen3_5Config) is named as one in the same error
    assert ("verl.megatron_vlm" in message) == (getattr(hf_config, "vision_config", None)
                                                 is not None)


@pytest.mark.parametrize("config_name", HYBRID_CONFIGS)
def test_hybrid_configs_are_recognised_and_attention_only_ones_are_not(config_name):
    assert is_gdn_hybrid(getattr(transformers, config_name)())
    assert not is_gdn_hybrid(transformers.Qwen2Config())
    assert hybrid_release_problem(model_config(transformers.Qwen2Config())) is None


def test_with_sharing_off_a_hybrid_reaches_verls_own_constructor(monkeypatch):
    """The refusal is sharing's: with the feature off the engine goes straight to verl's
    ``__init__`` (stubbed here: the real one sets up megatron's process groups)."""
    stock = engine_class().__mro__[2]  # PrefixSharingMegatronEngine, SharingEngineMixin, verl's
    reached = []
    monkeypatch.setattr(stock, "__init__", lambda self, *args, **kwargs: reached.append(args))
    config = actor_config(None)
    engine_class()(model_config(transformers.Qwen3NextConfig()), config.engine, config.optim,
                   config.checkpoint)
    assert len(reached) == 1
