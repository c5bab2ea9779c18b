"""verl 0.9's own recipes (``prefix_sharing.verl_ext.recipes``: the CSV's rows reduced to their
setting combinations), each as the sharing engines take it.

verl 0.9.1 only (the CSV is verl 0.9's launches). Every combination gets its verdict checked in
one one-rank process (megatron-lite, which verl 0.9.1 has no engine or config for: its RL
launch by preflight alone, the strategy named; its SFT launch by test_recipes): ``preflight`` of its
overrides on a tiny config of its family gives per role the verdict's keys, and constructing the
engine verl selects from the same configs raises them - the Megatron engine's RL and SFT
combinations (tensor, pipeline, context and expert sizes above 1 at 2: construction reads them
without megatron's parallel state; interleaved stages, rope fusion, router replay, MTP, LoRA,
the critic), the VeOmni ones (refused by name, ``model_engine=veomni``), and the SFT trainer's
on every engine (FSDP, Megatron, AutoModel). MiMo (no config in transformers) stands in as
Qwen2's config (with its one MTP layer). What the sharing layers refuse when the model is
built (DeepSeek-V4's sparse attention, MTP layers, a Mamba-2 hybrid's layers) the engine says
at construction, from the configs; each Megatron row's model is also built here (a tiny GPT
model with the sharing layer spec, its config given the fields verl's bridge maps the row's
configs to) and raises the verdict's build keys - but a hybrid stack (megatron-core 0.18+:
tests/megatron_ext/test_hybrid.py) and rows refused before the model is built. Keys raised per
micro-batch are the verdict's, not construction's. The served Megatron RL combinations' engine
steps run in ``test_verl_recipes_megatron.py``. For the FSDP engine's RL combinations:

- ``preflight`` of the recipe's overrides (strategy, Ulysses, padding, fused kernels, gradient
  checkpointing, dynamic bsz, entropy switches, loss mode, LoRA, ``calculate_sum_pi_squared``,
  GAE for a critic) gives the combination's verdict keys for the actor and the reference, and
  constructing the registered engine from the same configs raises the same keys (the refused
  VLM families, GLM-4.1V, and the Ulysses refusals of a recurrent or vision-language model,
  which the engine now says at construction); a critic's role is served, but under Ulysses
  (``verl.critic.sequence_split``). The HF config of each family is transformers' default for its model type; MiniCPM-o
  has none in transformers (remote code only), so its refusal is checked on a config that says
  ``minicpmo`` with a vision tower.
- the served text-family combinations, one engine step each - those at one rank in one
  spawned process, the Ulysses ones (FSDP1 and FSDP2, any size > 1 run at 2) in one more of two
  ranks - sharing on against the same engine with it off (``_fsdp_engine``: verl's
  ``initialize()`` on a tiny seeded checkpoint of the family, ``infer_batch`` then
  ``forward_backward_batch`` with verl's ``ppo_loss`` at the recipe's loss mode), fp32 within
  1e-5: log-probs, entropy, the step's loss and every gradient, on a GRPO batch. gpt-oss's
  reference is verl's padded step (``test_fsdp_windowed``); the Ulysses reference is verl's own
  Ulysses wrapper over a CPU kernel (``test_fsdp_ulysses``). The refused-at-step
  ``calculate_sum_pi_squared`` is asserted as the engine's refusal. Every combination with the
  same engine settings shares one pair of engines (a loss mode or dynamic bsz changes the step,
  not the engine). GMPO's ``geo_mean`` under dynamic bsz keeps verl's micro-batches (its loss
  is a mean over the micro-batch's sequences); the control, the group-keeping split, fails.

Merged, and why (module budget: CI's verl runs; each merge is covered where named):

- ``use_torch_compile`` runs off on both sides (inductor compiles for minutes on CPU):
  ``test_fsdp_fused`` shows the sharing engine never calls verl's compiled function and gives
  bitwise the same outputs with it on;
- a critic (GAE) or k1 distillation changes no actor step: the step is the combination without
  them (the critic's own step: ``test_critic``; the distillation loss is verl's over the log-probs
  checked here, ``distillation_use_topk`` off);
- the vision-language combinations (Qwen2.5-VL, Qwen3-VL, Qwen3.5 dense and MoE) run per
  family in ``test_fsdp_vlm`` (FSDP2, images and text-only), FSDP1 in ``test_fsdp_engine``,
  fused kernels and the entropy switches in ``test_fsdp_fused``, LoRA in ``test_fsdp_lora``;
  their verdicts are checked here;
- Qwen3-Next under Ulysses and Qwen3-VL-MoE under Ulysses are refused at construction
  (checked above), so they run no step.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import version

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)
if version("verl") != "0.9.1":
    pytest.skip(f"the recipe table is verl 0.9's launches; verl {version('verl')} is installed",
                allow_module_level=True)

import dataclasses  # noqa: E402
from functools import partial  # noqa: E402

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from prefix_sharing.verl_ext.recipes import (MODEL_BUILD_KEYS, STAND_IN_FIELDS,  # noqa: E402
                                             STAND_IN_TYPES, Combination, combinations)
from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import PRESET, save_model  # noqa: E402
from tests.verl_ext.test_preflight import BASE, MODEL, MOOT_MAKERS, model_build_keys  # noqa: E402

ACTOR = "actor_rollout_ref.actor."
SHARED = MODES["arbitrary_prefix"]
BUDGET = 110  # dynamic bsz: verl splits the GRPO batch (138 tokens) in two
CONTROL_LOSS = "geo_mean"  # its loss is a mean over the micro-batch's sequences
TINY = dataclasses.replace(PRESET, full_attention_every=2)
RL = {c: rows for c, rows in combinations().items()
      if c.trainer == "rl" and c.strategy in ("fsdp", "fsdp2")}
# every other engine's RL launches: their verdicts (no engine step here)
OTHER_RL = {c: rows for c, rows in combinations().items()
            if c.trainer == "rl" and c.strategy not in ("fsdp", "fsdp2")}
# the SFT trainer's launches on every engine verl 0.9.1 has (megatron-lite's: test_recipes)
SFT = {c: rows for c, rows in combinations().items()
       if c.trainer == "sft" and c.strategy != "megatron_lite"}
SFT_SHARING = ["+engine.use_prefix_grouper=true", "+engine.prefix_grouper.mode=arbitrary_prefix"]
# the engine class preflight and verl's registry select, per strategy
ENGINE_CLASSES = {"fsdp": "PrefixSharingFSDPEngine", "fsdp2": "PrefixSharingFSDPEngine",
                  "megatron": "PrefixSharingMegatronEngine", "veomni": "veomniRefusal",
                  "automodel": "automodelRefusal", "megatron_lite": None}
# transformers has no MiniCPM-o config class: its verdict is checked on a stand-in config
NO_HF_CONFIG = {"minicpmo"}


def stepped(combination: Combination) -> bool:
    """Whether the one-rank process runs the combination's engine step (module doc)."""
    return (combination.trainer == "rl" and not combination.vision
            and not combination.verdict()[1])


def engine_settings(c: Combination) -> tuple:
    """What the engine is built with (the step's loss mode and dynamic bsz are not)."""
    return (c.strategy, c.family, c.remove_padding, c.fused_kernels, c.chunked_entropy,
            c.entropy_checkpointing, c.gradient_checkpointing, c.lora)


def step_settings(c: Combination) -> tuple:
    return (c.loss_mode, c.dynamic_bsz)


def common_overrides(c: Combination, path: str) -> list[str]:
    """What a recipe sets the same way on either engine (beyond test_preflight's BASE), with a
    KL loss (the reference is checked too) and GAE for a critic."""
    found = [MODEL + f"path={path}", ACTOR + "use_kl_loss=true",
             ACTOR + f"use_dynamic_bsz={c.dynamic_bsz}",
             ACTOR + f"policy_loss.loss_mode={c.loss_mode}",
             MODEL + f"use_remove_padding={c.remove_padding}",
             MODEL + f"use_fused_kernels={c.fused_kernels}"]
    if c.critic:
        found += ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2"]
    return found


def overrides(c: Combination, path: str) -> list[str]:
    """The recipe's hydra overrides for ``c`` on the FSDP engine."""
    found = common_overrides(c, path) + [
        ACTOR + f"strategy={c.strategy}", ACTOR + f"ulysses_sequence_parallel_size={c.ulysses}",
        ACTOR + f"entropy_from_logits_with_chunking={c.chunked_entropy}",
        ACTOR + f"entropy_checkpointing={c.entropy_checkpointing}",
        ACTOR + f"use_torch_compile={c.torch_compile}",
        ACTOR + f"calculate_sum_pi_squared={c.sum_pi_squared}",
        MODEL + f"enable_gradient_checkpointing={c.gradient_checkpointing}"]
    if c.lora:
        found.append(MODEL + "lora_rank=8")
    if c.critic:  # the recipe's critic runs at the actor's Ulysses size
        found.append(f"critic.fsdp.ulysses_sequence_parallel_size={c.ulysses}")
    return found


def megatron_overrides(c: Combination, path: str) -> list[str]:
    """A Megatron recipe's hydra overrides (on ``ppo_megatron_trainer``): parallel sizes above
    1 at 2 - the engine's construction reads them without megatron's parallel state, so one
    rank builds it."""
    mcore = ACTOR + "megatron."
    found = common_overrides(c, path) + [
        mcore + f"tensor_model_parallel_size={c.tensor_parallel}",
        mcore + f"pipeline_model_parallel_size={c.pipeline_parallel}",
        mcore + f"context_parallel_size={c.context_parallel}",
        mcore + f"expert_model_parallel_size={c.expert_parallel}"]
    if c.virtual_pipeline:
        found.append(mcore + "virtual_pipeline_model_parallel_size=2")
    if c.rope_fusion:
        found.append("+" + mcore + "override_transformer_config.apply_rope_fusion=true")
    if c.router_replay:
        found.append(mcore + f"router_replay.mode={c.router_replay}")
    if c.mtp_train:
        found += [MODEL + "mtp.enable=true", MODEL + "mtp.enable_train=true"]
    if c.lora:
        found.append(MODEL + "lora.rank=8")
    return found


def other_overrides(c: Combination, path: str) -> tuple[str, list[str]]:
    """verl's config and the overrides of an RL recipe on the Megatron or an unhooked engine."""
    if c.strategy == "megatron":
        return "ppo_megatron_trainer", megatron_overrides(c, path)
    if c.strategy == "megatron_lite":  # no config in verl 0.9.1: the strategy named
        return "ppo_trainer", [MODEL + f"path={path}", ACTOR + "strategy=megatron_lite",
                               ACTOR + "use_kl_loss=true"]
    return "ppo_trainer", [MODEL + f"path={path}", f"model_engine={c.strategy}",
                           ACTOR + "use_kl_loss=true"]


def sft_overrides(c: Combination, path: str) -> list[str]:
    """An SFT recipe's overrides on ``sft_trainer_engine``, asking for sharing in its engine
    section (parallel sizes above 1 at 2, as :func:`megatron_overrides`)."""
    engine = "fsdp" if c.strategy in ("fsdp", "fsdp2") else c.strategy
    found = [f"model.path={path}", f"engine={engine}", *SFT_SHARING,
             f"model.use_remove_padding={c.remove_padding}"]
    if engine == "fsdp":
        found += [f"engine.strategy={c.strategy}",
                  f"engine.ulysses_sequence_parallel_size={c.ulysses}",
                  f"model.enable_gradient_checkpointing={c.gradient_checkpointing}"]
        found += ["model.lora_rank=8"] if c.lora else []
    if engine == "megatron":
        found += [f"engine.tensor_model_parallel_size={c.tensor_parallel}",
                  f"engine.pipeline_model_parallel_size={c.pipeline_parallel}",
                  f"engine.context_parallel_size={c.context_parallel}",
                  f"engine.expert_model_parallel_size={c.expert_parallel}"]
    if c.mtp_train:
        found += ["model.mtp.enable=true", "model.mtp.enable_train=true"]
    return found


def config_dirs(root: str) -> dict[str, str]:
    """Per model type of the table (but MiniCPM-o), transformers' default config of it (a
    stand-in's for a type transformers lacks, ``STAND_IN_TYPES``)."""
    import os

    from transformers import AutoConfig

    from prefix_sharing.verl_ext.preflight import _architecture

    dirs = {}
    for model_type in {c.model_type for c in [*RL, *OTHER_RL, *SFT]} - NO_HF_CONFIG:
        config = AutoConfig.for_model(STAND_IN_TYPES.get(model_type, model_type),
                                      **STAND_IN_FIELDS.get(model_type, {}))
        config.architectures = [_architecture(config.model_type)]
        dirs[model_type] = os.path.join(root, model_type)
        config.save_pretrained(dirs[model_type])
    return dirs


def verdicts(rank: int, dirs: dict[str, str]) -> dict:
    """Per RL combination: each role's preflight keys, and the keys constructing the actor's
    engine from the configs preflight read raises (None where the engine needs more ranks than
    one: a served Ulysses combination)."""
    from prefix_sharing.errors import PrefixSharingSetupError
    from prefix_sharing.verl_ext.preflight import compose_config, preflight
    from tests.verl_ext._batch import use_cpu_platform

    use_cpu_platform()
    found = {}
    for c in RL:
        if c.model_type in NO_HF_CONFIG:
            continue
        checked = preflight(compose_config(BASE + overrides(c, dirs[c.model_type])))
        roles = {r.role: tuple(sorted(p.key for p in r.problems)) for r in checked.roles}
        actor = checked.roles[0]
        built = None
        if roles["actor"] or c.ulysses == 1:
            cfg = actor.configs
            built = ()
            try:
                actor.engine_cls(cfg["model"], cfg["engine"], cfg["optim"], cfg["checkpoint"])
            except PrefixSharingSetupError as error:
                built = tuple(sorted(error.refusals))
        found[c] = {"roles": roles, "built": built, "engine": actor.engine_cls.__name__}
    for c in [*OTHER_RL, *SFT]:
        if c.trainer == "sft":
            checked = preflight(compose_config(sft_overrides(c, dirs[c.model_type]),
                                               "sft_trainer_engine"))
        else:
            config_name, extra = other_overrides(c, dirs[c.model_type])
            checked = preflight(compose_config(BASE + extra, config_name))
        role, cfg = checked.roles[0], checked.roles[0].configs
        # None: a served Ulysses engine needs its ranks (test_fsdp_ulysses); verl 0.9.1 has
        # no megatron-lite engine to build
        built = None
        if role.engine_cls is not None and (role.problems or c.ulysses == 1):
            built = ()
            try:  # the SFT trainer's configs carry no optimizer or checkpoint config here
                role.engine_cls(cfg["model"], cfg["engine"], cfg.get("optim"),
                                cfg.get("checkpoint"))
            except PrefixSharingSetupError as error:
                built = tuple(sorted(error.refusals))
        found[c] = {"roles": {r.role: tuple(sorted(p.key for p in r.problems))
                              for r in checked.roles},
                    "built": built, "engine": getattr(role.engine_cls, "__name__", None)}
        if c.strategy == "megatron" and not set(c.verdict()[1]) & MOOT_MAKERS:
            found[c]["model_built"] = model_build_keys(cfg["model"], cfg["engine"])
    return found


def recipe_steps(rank: int, paths: dict[str, str], plan: dict, ulysses: int = 1) -> dict:
    """For each engine setting of ``plan`` (-> its step settings), a stock engine and a sharing
    one; each step on both; ``calculate_sum_pi_squared`` on the sharing one where asked.
    ``ulysses`` > 1: one Ulysses group of that many ranks, which share their batch; the stock
    engine runs verl's Ulysses wrapper over a CPU kernel (``test_fsdp_ulysses``)."""
    from unittest import mock

    import torch
    import transformers
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.errors import PrefixSharingSetupError
    from prefix_sharing.fsdp_compat.fsdp import full_gradients
    from prefix_sharing.verl_ext import engine as sharing_engine
    from prefix_sharing.verl_ext.mcore import prompt_lengths
    from tests.verl_ext._batch import make_batch, plain_output, use_cpu_platform
    from tests.verl_ext._fsdp_engine import actor_config, build_engine, count_sharing_attention

    use_cpu_platform()
    if ulysses > 1:
        from tests.verl_ext.test_fsdp_ulysses import REFERENCE_ATTENTION, use_reference_attention

        use_reference_attention()

    def kernel_calls() -> int:
        """Calls of the stock Ulysses wrapper's CPU kernel since the last reading."""
        if ulysses == 1:
            return 0
        from tests.verl_ext.test_fsdp_ulysses import KERNEL_CALLS

        calls, KERNEL_CALLS["n"] = KERNEL_CALLS["n"], 0
        return calls

    results = {}
    for settings, (steps, sum_pi_squared) in plan.items():
        strategy, family, remove_padding, fused, chunked, entckpt, gc, lora = settings
        model_type = next(c.model_type for c in RL if c.family == family)
        padded_reference = model_type == "gpt_oss"  # test_fsdp_windowed
        model = dict(enable_gradient_checkpointing=gc,
                     override_config={"attn_implementation": "eager" if padded_reference
                                      else "sdpa"})
        if lora:
            model.update(lora_rank=8, lora_alpha=16, target_modules="all-linear")
        if fused:
            model.update(use_fused_kernels=True, fused_kernel_options={"impl_backend": "torch"})
        engine_keys = dict(entropy_from_logits_with_chunking=chunked,
                           entropy_checkpointing=entckpt, use_fused_kernels=fused,
                           ulysses_sequence_parallel_size=ulysses)
        model_class = getattr(transformers, _architecture_name(paths[family]))
        stock_forward = model_class.forward  # verl's fused kernels replace it class-wide
        for side, grouper in (("off", None), ("on", SHARED)):
            packed = remove_padding and not (padded_reference and grouper is None)
            config = actor_config(grouper, remove_padding=packed, strategy=strategy,
                                  **engine_keys)
            if ulysses > 1 and grouper is None:
                model["override_config"] = {"attn_implementation": REFERENCE_ATTENTION}
            elif ulysses > 1:
                model["override_config"] = {"attn_implementation": "sdpa"}
            torch.manual_seed(0)  # a fresh LoRA adapter's A is drawn at random: the same in both
            try:
                engine = build_engine(config, paths[family], **model)
                for loss_mode, dynamic_bsz in steps:

                    def batch(**switches):
                        data = make_batch("grpo", seed=rank // ulysses)  # one per group
                        data.pop("temperature")  # one per batch (verl's fused kernels' rule)
                        tu.assign_non_tensor_data(data, "temperature", 0.9)
                        tu.assign_non_tensor(data, use_remove_padding=packed,
                                             use_fused_kernels=fused, **switches)
                        if dynamic_bsz:
                            tu.assign_non_tensor(data, use_dynamic_bsz=True,
                                                 max_token_len_per_gpu=BUDGET)
                        return data

                    loss = actor_config(grouper, strategy=strategy,
                                        section=dict(policy_loss=dict(
                                            _target_="verl.workers.config.PolicyLossConfig",
                                            loss_mode=loss_mode)))
                    with count_sharing_attention() as calls:
                        with engine.eval_mode():
                            infer = engine.infer_batch(batch())
                        with engine.train_mode():
                            train = engine.forward_backward_batch(
                                batch(), partial(ppo_loss, config=loss))
                            grads = full_gradients(engine.module)
                    result = {"infer": plain_output(infer), "train": plain_output(train),
                              "grads": grads, "engine": type(engine).__name__,
                              "attention_calls": calls["n"], "kernel_calls": kernel_calls(),
                              "read_from": [n - 1 for n in prompt_lengths(batch())]}
                    if sum_pi_squared and grouper is not None:
                        try:
                            with engine.eval_mode():
                                engine.infer_batch(batch(calculate_sum_pi_squared=True))
                            result["sum_pi_squared"] = ()
                        except PrefixSharingSetupError as error:
                            result["sum_pi_squared"] = tuple(error.refusals)
                    results[settings, (loss_mode, dynamic_bsz), side] = result
                    if grouper is not None and dynamic_bsz and loss_mode == CONTROL_LOSS:
                        # the control: the group-keeping split under a loss that depends on
                        # its micro-batches (the engine keeps verl's split for it)
                        with mock.patch.object(sharing_engine, "dynamic_split_problem",
                                               lambda *args: None), engine.train_mode():
                            control = engine.forward_backward_batch(
                                batch(), partial(ppo_loss, config=loss))
                            results["control"] = {**result, "train": plain_output(control),
                                                  "grads": full_gradients(engine.module)}
            finally:
                model_class.forward = stock_forward
    return results


def _architecture_name(path: str) -> str:
    import json
    import os

    with open(os.path.join(path, "config.json")) as handle:
        return json.load(handle)["architectures"][0]


def step_plan(ulysses: int) -> dict:
    """Engine settings at ``ulysses`` -> ``(steps: [(loss mode, dynamic bsz)], whether a recipe
    of them sets calculate_sum_pi_squared)``: one pair of engines each."""
    plan: dict = {}
    for c in RL:
        if c.ulysses == ulysses and (stepped(c) or c.sum_pi_squared):
            steps, sum_pi = plan.get(engine_settings(c), ([], False))
            if step_settings(c) not in steps:
                steps.append(step_settings(c))
            plan[engine_settings(c)] = (steps, sum_pi or c.sum_pi_squared)
    return plan


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny seeded checkpoint of each stepped family (Seed-OSS tied: verl's fused forward
    reads an untied head's sharded weight under FSDP2, test_fsdp_fused)."""
    paths = {}
    for settings in [*step_plan(1), *step_plan(2)]:
        family = settings[1]
        if family in paths:
            continue
        model_type = next(c.model_type for c in RL if c.family == family)
        preset = dataclasses.replace(TINY, tie_embeddings=True) if settings[3] else TINY
        paths[family] = save_model(str(tmp_path_factory.mktemp(model_type)), model_type,
                                   preset=preset)
    return paths


@pytest.fixture(scope="module")
def steps(checkpoints):
    """Every one-rank step, then every Ulysses step at two ranks (rank 0's; each rank's outputs
    and gradients are whole: verl gathers them)."""
    one = run_gloo(recipe_steps, 1, checkpoints, step_plan(1), timeout=900)[0]
    two = run_gloo(recipe_steps, 2, checkpoints, step_plan(2), 2, timeout=900)
    assert two[0].keys() == two[1].keys()
    return {**one, **{key: result for key, result in two[0].items() if key != "control"}}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    dirs = config_dirs(str(tmp_path_factory.mktemp("configs")))
    return run_distributed(verdicts, 1, dirs, timeout=500)[0]


@pytest.mark.parametrize("c", [c for c in [*RL, *OTHER_RL] if c.model_type not in NO_HF_CONFIG],
                         ids=lambda c: c.name)
def test_preflight_and_the_engine_give_the_combinations_verdict(checked, c):
    found = checked[c]
    keys = tuple(sorted(c.construction_keys()))
    assert found["engine"] == ENGINE_CLASSES[c.strategy]
    assert found["roles"]["actor"] == keys
    # verl's worker builds the reference without MTP
    assert found["roles"]["reference"] == tuple(k for k in keys
                                                if k not in ("verl.mtp", "megatron.mtp"))
    if found["built"] is not None:
        assert found["built"] == keys
    _the_model_build_raises_the_verdicts_build_keys(found, keys)
    assert ("critic" in found["roles"]) == c.critic
    if c.critic:  # served (tests/verl_ext/test_critic.py), but not under a sequence split
        assert found["roles"]["critic"] == (
            ("verl.critic.sequence_split",) if c.ulysses > 1 else ())


@pytest.mark.parametrize("c", list(SFT), ids=lambda c: c.name)
def test_preflight_and_the_engine_give_the_sft_combinations_verdict(checked, c):
    found = checked[c]
    keys = tuple(sorted(c.construction_keys()))
    assert found["engine"] == ENGINE_CLASSES[c.strategy]
    assert found["roles"] == {"sft": keys}
    if found["built"] is not None:
        assert found["built"] == keys
    _the_model_build_raises_the_verdicts_build_keys(found, keys)


def _the_model_build_raises_the_verdicts_build_keys(found: dict, keys: tuple) -> None:
    """A Megatron row (but one refused before its model is built, ``MOOT_MAKERS``): building
    its model with the sharing layer spec, from the configs preflight read, raises the
    verdict's keys of the model's build (none: it builds) - but a hybrid stack's, which needs
    megatron-core 0.18+ (tests/megatron_ext/test_hybrid.py)."""
    if found.get("model_built", None) is not None:
        assert found["model_built"] == tuple(k for k in keys if k in MODEL_BUILD_KEYS)


def test_the_megatron_rows_models_are_built_refused_and_served(checked):
    """The model-build comparison covers refused and served rows (not vacuous)."""
    built = [f["model_built"] for f in checked.values() if f.get("model_built") is not None]
    assert {key for keys in built for key in keys} == {"megatron.dsa"}
    assert built.count(()) >= 10


def test_a_vision_family_transformers_cannot_load_is_refused_by_name():
    """MiniCPM-o (remote code only): the engine's check on a config saying so."""
    import types

    from tests.verl_ext._fsdp_engine import actor_config, engine_class

    minicpm = [c for c in RL if c.model_type == "minicpmo"]
    assert minicpm
    engine = actor_config(SHARED, strategy=minicpm[0].strategy).engine
    model = types.SimpleNamespace(hf_config=types.SimpleNamespace(
        model_type="minicpmo", vision_config=object()))
    for c in minicpm:
        assert tuple(p.key for p in engine_class(c.strategy).setup_problems(model, engine)) == (
            c.construction_keys())


def test_the_docs_name_an_engine_step_exactly_for_the_combinations_stepped_here():
    for c in RL:
        assert c.evidence().startswith("engine step") == stepped(c), c.name


@pytest.mark.parametrize("c", [c for c in RL if stepped(c)], ids=lambda c: c.name)
def test_the_recipes_shared_step_equals_verls_stock_step(steps, c):
    key = (engine_settings(c), step_settings(c))
    on, off = steps[(*key, "on")], steps[(*key, "off")]
    if c.ulysses > 1:  # verl's Ulysses wrapper ran on the stock side (test_fsdp_ulysses)
        assert off["kernel_calls"] > 0 and on["kernel_calls"] == 0
    assert on["engine"] == "PrefixSharingFSDPEngine"
    assert on["attention_calls"] > 0 and off["attention_calls"] == 0
    metrics = on["train"]["metrics"]
    assert metrics["prefix_sharing/tokens_computed"][0] < metrics["prefix_sharing/tokens_total"][0]
    same_outputs(on, off, c.name, per_micro_batch=False)


def test_the_loss_modes_change_verls_loss_so_their_comparisons_are_not_vacuous(steps):
    """The control: each recipe loss mode gives another loss than vanilla on the same engine."""
    by_engine: dict = {}
    for key, result in steps.items():
        if key != "control" and key[2] == "off":
            settings, (loss_mode, dynamic_bsz), _ = key
            by_engine.setdefault((settings, dynamic_bsz), {})[loss_mode] = sum(
                result["train"]["loss"])
    modes = {m for losses in by_engine.values() for m in losses} - {"vanilla"}
    assert modes >= {"gspo", "cispo", "geo_mean", "gpg", "sapo"}
    compared = [losses for losses in by_engine.values() if "vanilla" in losses and len(losses) > 1]
    assert compared
    for losses in compared:
        assert all(abs(v - losses["vanilla"]) > 1e-6 for m, v in losses.items() if m != "vanilla")


def test_a_loss_of_its_micro_batches_keeps_verls_dynamic_split(steps):
    """GMPO's ``geo_mean`` averages over the micro-batch's sequences: the sharing engine keeps
    verl's two micro-batches (sharing within each) and gives verl's gradients; the control, the
    group-keeping split (one micro-batch), does not."""
    key = next(k for k in steps if k != "control" and k[1] == (CONTROL_LOSS, True)
               and k[2] == "on")
    on, off = steps[key], steps[(*key[:2], "off")]
    assert len(on["train"]["loss"]) == len(off["train"]["loss"]) == 2
    control = steps["control"]
    assert len(control["train"]["loss"]) == 1
    with pytest.raises(AssertionError, match="grad"):
        same_outputs(control, off, "control", per_micro_batch=False)


def test_calculate_sum_pi_squared_is_refused_per_micro_batch(steps):
    refused = [r["sum_pi_squared"] for r in steps.values() if "sum_pi_squared" in r]
    expected = {c.verdict()[1] for c in RL if c.sum_pi_squared}
    assert refused and set(refused) == expected == {("verl.micro_batch_switch",)}
