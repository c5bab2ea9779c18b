"""verl 0.9's Megatron recipes (``prefix_sharing.verl_ext.recipes``): each served RL
combination's engine step, sharing on against verl 0.9.1's Megatron engine with it off, on the
same seeded weights (``_engine``: the registered engine, tiny model injected, ``infer_batch``
then ``forward_backward_batch`` with verl's ``ppo_loss`` at the recipe's loss mode), fp32
within 1e-5: old log-probs, entropy, the step's loss and every gradient, on a GRPO batch; the
sharing run must compute fewer tokens than it was given (sharing engaged). Their verdicts,
and the refused combinations', are checked by ``test_verl_recipes``.

The family's tiny model: Qwen2.5 the dense ``tiny`` preset; Qwen3 the same with QK layernorm;
Qwen3-MoE the ``tiny-moe`` preset (sharp weights, QK layernorm); DeepSeek-V3, Moonlight and
DeepSeek-V4 (read as DeepSeek-V3's architecture, as preflight reads them) ``test_mcore_mla``'s
MLA model (q LoRA, MoE with a shared expert). The recipe's switches as the engine takes them:
``use_fused_kernels`` (verl's fused kernel a CPU stand-in, ``test_mcore_fused``: the stock
side must call it), ``apply_rope_fusion`` (TE's fused RoPE a CPU stand-in,
``test_mcore_rope_fusion``: the stock side's THD kernel, the sharing side's BSHD one),
megatron's full recompute for gradient checkpointing, MTP training (``model.mtp``: one MTP
layer, verl's patched postprocess on the stock side, ``test_mcore_mtp``), dynamic bsz (a token
budget that splits the batch on both sides) and the policy loss mode.

Merged, and why (CI budget: one process of two gloo ranks):

- every combination runs at TP=2 with sequence parallelism (the recipes' most common parallel
  layout; the harness initialises megatron's parallel state once per process), whatever its
  pipeline, context and expert sizes: those run per setting in ``test_cross_pipeline``,
  ``test_context_parallel`` and ``test_cross_moe_sequence_parallel`` (each test's docstring);
- every sample has an even length, and the MoE models' router losses are ``aux_loss`` and
  ``global_aux_loss`` (``test_mcore_mla``'s module doc: verl's stock step pads samples to a
  multiple of TP and megatron's router counts the pad rows; ``seq_aux_loss`` and the z-loss
  are defined differently by verl's packed layout, docs/moe.md); under dynamic bsz a MoE
  model's sharing step keeps verl's own split (the router's statistics are each
  micro-batch's own: ``microbatch.dynamic_split_problem``), which the control shows matters,
  and so does an MTP-training one's (the MTP loss is each micro-batch's average);
- router replay (R3) runs off on both sides (its routes are the batch's: ``test_routing_replay``
  runs R2 and R3 against verl's own replay);
- a critic (GAE) changes no actor step (its own: ``test_critic``); the Qwen3 recipe's top-k
  distillation (``forward_kl_topk``: verl's trainer sets ``distillation_use_topk`` on every
  actor batch) is refused per micro-batch, which is asserted on the sharing engine;
- ``use_torch_compile`` is not read by the Megatron engine.
"""

from __future__ import annotations

from types import SimpleNamespace

from tests.verl_ext._requires import require_verl

require_verl("0.9.1")

import pytest  # noqa: E402

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from prefix_sharing.verl_ext.recipes import (  # noqa: E402
    TOPK_DISTILLATION,
    Combination,
    combinations,
)
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402

BUDGET = 60  # dynamic bsz: the GRPO batch (138 tokens, 76 computed) split on both sides
TP = 2
MOE = {"qwen3_moe", "deepseek_v3", "deepseek_v4"}
# the control's step: a MoE's sharing step on the group-keeping split instead of verl's
GROUP_SPLIT = (("qwen3_moe", False, False, False, False), ("vanilla", True))
MEGATRON_RL = [c for c in combinations() if c.trainer == "rl" and c.strategy == "megatron"]
# model.mtp of a recipe that trains MTP (MiMo: one MTP layer; verl's defaults)
MTP_TRAINED = SimpleNamespace(enable=True, enable_train=True, detach_encoder=False,
                              mtp_loss_scaling_factor=0.1)


def stepped(c: Combination) -> bool:
    """Whether the two-rank process runs the combination's engine step (module doc)."""
    return c.verdict()[0] == "served" and not c.vision


def keeps_verls_split(c: Combination) -> bool:
    """Whether the model's statistics are each micro-batch's own (a MoE router's losses, the
    MTP loss's average), so that dynamic bsz keeps verl's split (module doc)."""
    return c.model_type in MOE or c.mtp_train


def engine_settings(c: Combination) -> tuple:
    """What the engine and its model are built with (the step's loss mode and dynamic bsz are
    not)."""
    return (c.model_type, c.fused_kernels, c.rope_fusion, c.gradient_checkpointing,
            c.mtp_train)


def step_settings(c: Combination) -> tuple:
    return (c.loss_mode, c.dynamic_bsz)


def step_plan() -> dict:
    """Engine settings -> the step settings of its combinations: one pair of engines each."""
    plan: dict = {}
    for c in MEGATRON_RL:
        if stepped(c) and step_settings(c) not in plan.setdefault(engine_settings(c), []):
            plan[engine_settings(c)].append(step_settings(c))
    return plan


def _model(model_type: str) -> tuple:
    """The family's tiny model: ``(preset, layer spec arguments, TransformerConfig fields)``."""
    from prefix_sharing.presets import PRESETS, sharp
    from tests.verl_ext import test_mcore_mla as mla
    from tests.verl_ext._batch import PRESET
    from tests.verl_ext._engine import ROUTER_LOSSES

    if model_type in MOE - {"qwen3_moe"}:
        return mla.PRESET, dict(num_experts=mla.PRESET.num_experts, multi_latent_attention=True,
                                qk_layernorm=True), ROUTER_LOSSES
    if model_type == "qwen3_moe":
        moe = sharp(PRESETS["tiny-moe"])
        return moe, dict(num_experts=moe.num_experts, qk_layernorm=True), ROUTER_LOSSES
    return PRESET, dict(qk_layernorm=model_type == "qwen3"), {}


def recipe_steps(rank: int, plan: dict) -> dict:
    """Per engine setting and step setting of ``plan``, each side's step on a fresh engine."""
    import contextlib
    from unittest import mock

    from verl.utils import tensordict_utils as tu

    import prefix_sharing.verl_ext.engine as sharing_engine
    from prefix_sharing.engines.megatron import finalize_sequence_parallel_grads
    from prefix_sharing.verl_ext import microbatch
    from prefix_sharing.verl_ext.mcore import prompt_lengths
    from tests.megatron_ext import fake_fused_rope
    from tests.verl_ext import fake_linear_cross_entropy
    from tests.verl_ext._batch import make_batch, use_cpu_platform
    from tests.verl_ext._engine import actor_config, build_engine, step
    from tests.verl_ext.test_cross_forward import RECOMPUTE

    use_cpu_platform()
    results = {}
    for settings, steps in plan.items():
        model_type, fused, rope_fusion, recompute, mtp_train = settings
        preset, spec, fields = _model(model_type)
        fields = {**fields, **(RECOMPUTE["full"] if recompute else {}),
                  **({"apply_rope_fusion": True} if rope_fusion else {}),
                  **({"mtp": MTP_TRAINED, "mtp_num_layers": 1} if mtp_train else {})}
        for loss_mode, dynamic_bsz in steps:

            def data(dynamic_bsz=dynamic_bsz):
                batch = make_batch("grpo", even_lengths=True)
                if dynamic_bsz:
                    tu.assign_non_tensor(batch, use_dynamic_bsz=True,
                                         max_token_len_per_gpu=BUDGET)
                return batch

            control = (settings, (loss_mode, dynamic_bsz)) == GROUP_SPLIT
            for side in ("on", "off", *(("group_split",) if control else ())):
                config = actor_config(
                    MODES["arbitrary_prefix"] if side != "off" else None,
                    megatron=dict(tensor_model_parallel_size=TP, sequence_parallel=True),
                    policy_loss=dict(_target_="verl.workers.config.PolicyLossConfig",
                                     loss_mode=loss_mode))
                config.engine.use_fused_kernels = fused
                with contextlib.ExitStack() as stack:
                    kernels = stack.enter_context(fake_linear_cross_entropy.installed())
                    rope = stack.enter_context(fake_fused_rope.installed())
                    if side == "group_split":  # the MoE's statistics not heeded
                        stack.enter_context(mock.patch.object(
                            sharing_engine, "dynamic_split_problem",
                            lambda *args: microbatch.dynamic_split_problem(*args[:4])))
                    engine = build_engine(config, preset=preset, spec=spec,
                                          sequence_parallel=True, **fields)
                    if fused:
                        engine._maybe_enable_fused_kernels()  # as verl's initialize() does
                    result = step(engine, config, data,
                                  finalize=finalize_sequence_parallel_grads)
                result.update(engine=type(engine).__name__, kernel_calls=len(kernels),
                              rope_calls=set(rope), read_from=[n - 1 for n in
                                                               prompt_lengths(data())])
                results[settings, (loss_mode, dynamic_bsz), side] = result
    results["topk_distillation"] = _topk_distillation_refusal()
    return results


def _topk_distillation_refusal() -> tuple[str, ...]:
    """The sharing engine's refusal of an update batch carrying ``distillation_use_topk`` (what
    verl's trainer sets for a top-k distillation loss), ``()`` if it ran."""
    from verl.utils import tensordict_utils as tu

    from prefix_sharing.errors import PrefixSharingSetupError
    from tests.verl_ext._batch import make_batch
    from tests.verl_ext._engine import actor_config, build_engine, step

    config = actor_config(MODES["arbitrary_prefix"], megatron=dict(
        tensor_model_parallel_size=TP, sequence_parallel=True))
    batch = make_batch("grpo")
    tu.assign_non_tensor(batch, distillation_use_topk=True)
    try:
        step(build_engine(config, sequence_parallel=True), config, lambda: batch)
    except PrefixSharingSetupError as error:
        return tuple(error.refusals)
    return ()


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_distributed(recipe_steps, TP, step_plan(), tp=TP, timeout=900)


def test_every_served_megatron_combination_is_stepped():
    served = [c for c in MEGATRON_RL if c.verdict()[0] == "served"]
    assert served and all(stepped(c) for c in served)
    for c in MEGATRON_RL:
        assert c.evidence().startswith("engine step") == stepped(c), c.name


@pytest.mark.parametrize("c", [c for c in MEGATRON_RL if stepped(c)], ids=lambda c: c.name)
def test_the_megatron_recipes_shared_step_equals_verls_stock_step(per_rank, c):
    key = (engine_settings(c), step_settings(c))
    for rank, found in enumerate(per_rank):
        on, off = found[(*key, "on")], found[(*key, "off")]
        assert on["engine"] == "PrefixSharingMegatronEngine"
        metrics = on["train"]["metrics"]
        computed, total = (metrics[f"prefix_sharing/tokens_{k}"] for k in ("computed", "total"))
        if c.dynamic_bsz and keeps_verls_split(c):  # which may cut every group
            assert computed <= total
        else:
            assert computed < total
        assert "prefix_sharing/tokens_total" not in off["train"]["metrics"]
        if c.fused_kernels:  # verl's fused kernel ran on the stock side only
            assert off["kernel_calls"] > 0 and on["kernel_calls"] == 0
        else:
            assert off["kernel_calls"] == on["kernel_calls"] == 0
        # TE's fused RoPE: verl's packed (THD) call stock, each flat row's own position shared
        assert (on["rope_calls"], off["rope_calls"]) == (
            ({"sbhd"}, {"thd"}) if c.rope_fusion else (set(), set()))
        if c.dynamic_bsz:  # the budget split the batch, on both sides (a MoE: the same split)
            assert len(off["train"]["loss"]) > 1 and len(on["train"]["loss"]) > 1
            if keeps_verls_split(c):
                assert len(off["train"]["loss"]) == len(on["train"]["loss"])
        same_outputs(on, off, f"rank {rank} {c.name}", per_micro_batch=False)


def test_the_loss_modes_change_verls_loss_so_their_comparisons_are_not_vacuous(per_rank):
    """The control: each recipe loss mode gives another stock loss than vanilla on the same
    family and batch split (fused kernels, rope fusion and recompute change no loss)."""
    losses = {(key[0][0], key[1]): sum(result["train"]["loss"])
              for key, result in per_rank[0].items() if key[-1] == "off"}  # (family, step)
    others = {(family, (mode, dyn)): loss for (family, (mode, dyn)), loss in losses.items()
              if mode != "vanilla"}
    assert {mode for _, (mode, _) in others} == {"gpg", "dppo_tv", "gspo"}
    for (family, (mode, dyn)), loss in others.items():
        assert abs(loss - losses[family, ("vanilla", dyn)]) > 1e-6, (family, mode)


def test_a_moe_step_under_dynamic_bsz_keeps_verls_split(per_rank):
    """The control: the sharing step on its group-keeping split (GRPO groups whole where verl's
    balances tokens) differs from verl's stock step, as the router's statistics are each
    micro-batch's own; the sharing engine keeps verl's split there (module doc)."""
    for found in per_rank:
        with pytest.raises(AssertionError, match="grad"):
            same_outputs(found[(*GROUP_SPLIT, "group_split")], found[(*GROUP_SPLIT, "off")],
                         "the group-keeping split", per_micro_batch=False)


def test_a_top_k_distillation_recipe_is_refused_per_micro_batch(per_rank):
    refused = {c.verdict()[1] for c in MEGATRON_RL if c.distillation in TOPK_DISTILLATION}
    assert refused == {("verl.micro_batch_switch",)}
    for found in per_rank:
        assert (found["topk_distillation"],) == tuple(refused)
