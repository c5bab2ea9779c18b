"""Setups where sharing would change the results are refused, naming the setting."""

from __future__ import annotations

import types

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.megatron_ext import PrefixSharingCoreAttention, UnsupportedSetupError
from prefix_sharing.megatron_ext.checks import check_layer_config, check_sharing_allowed

from ._distributed import run_distributed, tiny_gpt
from ._equivalence import micro_batches

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
            attention_dropout=0.0)
SHARED = build_plan([[1, 2, 3, 4], [1, 2, 3, 5]], PrefixSharingConfig(min_prefix_len=1))
INTERLEAVED = dict(num_layers=4, pipeline_model_parallel_size=2,
                   virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
PLAIN = build_plan([[1, 2, 3, 4], [1, 2, 3, 5]], PrefixSharingConfig(mode="off"))


class _OneRank:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def core_attention(config: TransformerConfig) -> PrefixSharingCoreAttention:
    return PrefixSharingCoreAttention(config, 1, AttnMaskType.causal, "self",
                                      pg_collection=types.SimpleNamespace(tp=_OneRank()))


@pytest.mark.parametrize("setting, message", [
    (dict(context_parallel_size=2, num_moe_experts=4, calculate_per_token_loss=True),
     "context_parallel_size=2 with num_moe_experts and calculate_per_token_loss=True"),
    (dict(window_size=(8, 2)), r"window_size=\(8, 2\); use window_size=\(8, 0\)\): a causal "
                               "sliding window"),
    (dict(mrope_section=[2, 2, 2]), "mrope_section is set"),
    (dict(INTERLEAVED, overlap_p2p_comm=False),
     r"virtual_pipeline_model_parallel_size=2 at pipeline_model_parallel_size=2 with "
     r"overlap_p2p_comm=False\): at pipeline_model_parallel_size=2 megatron's interleaved"),
])
def test_layer_refuses_settings_it_cannot_serve(setting, message):
    with pytest.raises(UnsupportedSetupError, match=message):
        core_attention(TransformerConfig(**{**BASE, **setting}))


@pytest.mark.parametrize("setting", [
    dict(INTERLEAVED, overlap_p2p_comm=True, batch_p2p_comm=False),  # verl's, Megatron-LM's
    dict(INTERLEAVED, pipeline_model_parallel_size=4, num_layers=8),  # neighbours differ
])
def test_interleaved_stages_are_served(setting):
    """Run in tests/megatron_ext/test_virtual_pipeline.py; refused only where megatron's
    schedule would hand a stage a gradient for an activation (above)."""
    core_attention(TransformerConfig(**{**BASE, **setting}))


@pytest.mark.parametrize("setting, message", [
    (dict(experimental_attention_variant="dsa"),
     r"DeepSeek sparse attention \(experimental_attention_variant='dsa'\)"),
    (dict(mtp_num_layers=1, mtp_use_repeated_layer=True),
     r"multi-token prediction not planned per depth \(mtp_num_layers=1 with "
     r"mtp_use_repeated_layer=True\)"),
])
def test_deepseek_settings_sharing_cannot_serve_are_refused(setting, message):
    """DSA's top-k indexer, and MTP where its depths are not planned (tests/megatron_ext/
    test_mtp.py runs it at TP=1 and TP=2). Set on a built config:
    megatron's own validation of these settings asks for unrelated fields (DSA's indexer
    sizes, MLA's head dims) that do not change what is refused."""
    config = TransformerConfig(**BASE)
    for name, value in setting.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedSetupError, match=message):
        check_layer_config(config)


@pytest.mark.parametrize("context_parallel_size", [1, 2])
def test_multi_latent_attention_is_served(context_parallel_size):
    """Also under context parallelism (tests/megatron_ext/test_context_parallel_mla.py)."""
    config = TransformerConfig(**BASE)
    config.multi_latent_attention = True
    config.context_parallel_size = context_parallel_size
    check_layer_config(config)


# each condition the layer's build checks, as the configuration alone says it (what verl's
# engine and preflight call, tests/verl_ext/test_preflight.py): its function, a setting, its key
BUILD_CONDITIONS = {
    "context_parallel_problems": (dict(context_parallel_size=2, num_moe_experts=4,
                                       calculate_per_token_loss=True),
                                  "megatron.context_parallel.moe_per_token_loss"),
    "attention_variant_problems": (dict(experimental_attention_variant="dsa"), "megatron.dsa"),
    "mtp_problems": (dict(mtp_num_layers=1, mtp_use_repeated_layer=True), "megatron.mtp"),
    "mrope_problems": (dict(mrope_section=[2, 2, 2]), "megatron.mrope"),
    "window_problems": (dict(window_size=(8, 2)), "megatron.window_reads_later_keys"),
    "rope_fusion_problems": (dict(apply_rope_fusion=True, multi_latent_attention=True),
                             "megatron.rope_fusion"),
}


@pytest.mark.parametrize("function", list(BUILD_CONDITIONS))
def test_each_build_condition_is_one_function_the_layers_build_raises_from(function):
    """The function gives its key from the config alone (any object with the fields), and
    building the layer on that config raises the same key, and only it."""
    import types as namespace

    from prefix_sharing.megatron_ext import checks

    setting, key = BUILD_CONDITIONS[function]
    config = TransformerConfig(**BASE)
    for name, value in setting.items():  # set on a built config (see the DeepSeek test)
        setattr(config, name, value)
    assert [p.key for p in getattr(checks, function)(config)] == [key]
    assert [p.key for p in checks.layer_config_problems(namespace.SimpleNamespace(**{
        name: getattr(config, name) for name in dir(config) if not name.startswith("_")}))] == [key]
    with pytest.raises(UnsupportedSetupError) as raised:
        core_attention(config)
    assert raised.value.refusals == (key,)
    assert all(not getattr(checks, other)(TransformerConfig(**BASE))
               for other in BUILD_CONDITIONS)  # the plain config: none


def test_context_parallel_layer_is_built_but_plain_inputs_are_refused():
    """CP > 1 splits only planned micro-batches (tests/megatron_ext/test_context_parallel.py)."""
    layer = core_attention(TransformerConfig(**BASE, context_parallel_size=2))
    assert layer.config.context_parallel_size == 2
    q = torch.zeros(4, 1, 4, 16)
    with pytest.raises(UnsupportedSetupError,
                       match=r"context_parallel_size=2\): .*prepare_micro_batch"):
        layer(q, q, q, None)


def test_fused_rope_is_refused_with_mla_only():
    """GPT attention keeps TE's fused RoPE (tests/megatron_ext/test_self_attention.py); MLA's
    fused kernels take positions from cu_seqlens."""
    config = TransformerConfig(**BASE)
    config.apply_rope_fusion = True  # needs TE to construct; the check reads the flag
    check_layer_config(config)
    config.multi_latent_attention = True
    with pytest.raises(UnsupportedSetupError,
                       match="apply_rope_fusion=True with multi_latent_attention=True.*"
                             "set apply_rope_fusion=False"):
        check_layer_config(config)


@pytest.mark.parametrize("setting, message", [
    (dict(hidden_dropout=0.1), r"hidden dropout in training \(hidden_dropout=0.1\)"),
    (dict(num_moe_experts=4, moe_expert_capacity_factor=1.0, moe_aux_loss_coeff=0.0,
          moe_token_dispatcher_type="alltoall"), "moe_expert_capacity_factor=1.0"),
    (dict(num_moe_experts=4, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0,
          moe_router_topk=1), "moe_router_load_balancing_type='sinkhorn'"),
    (dict(num_moe_experts=4, moe_input_jitter_eps=0.01),
     r"router input jitter in training \(moe_input_jitter_eps=0.01\)"),

    (dict(num_moe_experts=4, moe_router_force_load_balancing=True),
     "moe_router_force_load_balancing=True"),
])
def test_sharing_refuses_settings_that_would_change_the_results(setting, message):
    config = TransformerConfig(**{**BASE, **setting})
    with pytest.raises(UnsupportedSetupError, match=message):
        check_sharing_allowed(config, SHARED, training=True)
    check_sharing_allowed(config, PLAIN, training=True)  # the plain layout is always fine


def test_routing_replay_is_allowed_but_not_with_the_fused_router():
    config = TransformerConfig(**{**BASE, "num_moe_experts": 4, "moe_enable_routing_replay": True})
    check_sharing_allowed(config, SHARED, training=True)  # each row replays its own route
    config.moe_router_fusion = True  # needs TE to construct; the check reads the flag
    with pytest.raises(UnsupportedSetupError, match="fused top-k ignores the replayed routes"):
        check_sharing_allowed(config, SHARED, training=True)


def _since(field: str) -> pytest.MarkDecorator:
    """Skips where this megatron-core release's TransformerConfig has no ``field``."""
    return pytest.mark.skipif(field not in TransformerConfig.__dataclass_fields__,
                              reason=f"TransformerConfig.{field} is newer than this release")


@pytest.mark.parametrize("setting, message", [
    pytest.param(dict(moe_router_force_biased=0.5), "moe_router_force_biased=0.5",
                 marks=_since("moe_router_force_biased")),  # 0.17+
    pytest.param(dict(moe_router_load_balancing_type="quantile_balancing"),
                 "moe_router_load_balancing_type='quantile_balancing'",
                 marks=_since("moe_router_quantile_balancing_ema")),  # 0.19+
    pytest.param(dict(moe_expert_rank_capacity_factor=1.5),
                 "moe_expert_rank_capacity_factor=1.5",
                 marks=_since("moe_expert_rank_capacity_factor")),  # 0.18+
])
@pytest.mark.mcore_release_check
def test_sharing_refuses_newer_releases_settings(setting, message):
    """Settings of megatron-core 0.17+ that draw per computed token or count the batch's tokens.
    Set after construction: their validation needs a GPU-only dispatcher or TE, the check reads
    the value."""
    config = TransformerConfig(**BASE, num_moe_experts=4, moe_aux_loss_coeff=0.0)
    for name, value in setting.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedSetupError, match=message):
        check_sharing_allowed(config, SHARED, training=True)
    check_sharing_allowed(config, PLAIN, training=True)


def test_moe_router_losses_and_expert_bias_are_allowed_while_sharing():
    """The router reweights them by token multiplicity (tests/megatron_ext/test_moe.py)."""
    config = TransformerConfig(**BASE, num_moe_experts=4, moe_router_score_function="sigmoid",
                               moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                               moe_aux_loss_coeff=[0.01, 0.01], moe_z_loss_coeff=0.001,
                               moe_router_enable_expert_bias=True)
    check_sharing_allowed(config, SHARED, training=True)


def test_dropout_is_fine_outside_training():
    check_sharing_allowed(TransformerConfig(**{**BASE, "hidden_dropout": 0.1}), SHARED, training=False)


def _model_level_job(rank: int) -> dict:
    """Errors raised by a real forward: dropout, and stages given different micro-batches."""
    from megatron.core import parallel_state

    from prefix_sharing.megatron_ext import assert_same_plan, prepare_micro_batch

    def error_of(fn):
        try:
            fn()
        except UnsupportedSetupError as e:
            return str(e)
        return None

    seqs = micro_batches(["grpo"])[0]
    errors = {}
    dropout_model = tiny_gpt(attention_dropout=0.1)
    mb = prepare_micro_batch(seqs, PrefixSharingConfig(min_prefix_len=1), device="cpu")
    forward = lambda: dropout_model(mb.input_ids, mb.position_ids, None,  # noqa: E731
                                    packed_seq_params=mb.packed_seq_params)
    if parallel_state.is_pipeline_first_stage():
        errors["attention_dropout"] = error_of(forward)
    # every stage plans its own copy; here stage 1 was handed a different micro-batch
    other = micro_batches(["tree"])[0] if rank == 1 else seqs
    mine = prepare_micro_batch(other, PrefixSharingConfig(min_prefix_len=1), device="cpu")
    errors["different_plans"] = error_of(
        lambda: assert_same_plan(mine.plan, parallel_state.get_pipeline_model_parallel_group()))
    model = tiny_gpt()
    if not parallel_state.is_pipeline_first_stage():  # a stage receiving the wrong activations
        hidden = torch.zeros(mb.plan.num_tokens_flat, 1, 64)
        model.set_input_tensor(hidden)
        errors["wrong_layout"] = error_of(lambda: model(
            mine.input_ids, mine.position_ids, None, packed_seq_params=mine.packed_seq_params))
    return errors


def test_forward_refuses_dropout_and_stages_with_different_plans():
    first, second = run_distributed(_model_level_job, 2, pp=2, timeout=300)
    assert "attention dropout in training (attention_dropout=0.1)" in first["attention_dropout"]
    for stage in (first, second):
        assert "ranks or stages with different sharing plans (the ranks' plan digests" in (
            stage["different_plans"])
    assert "different sharing plans (this layer received" in second["wrong_layout"]
