"""Whether prefix sharing applies to each role of a verl launch, before anything is built.

verl's trainer config is composed the way verl composes it (hydra, from the config directory
of the installed verl: its generated defaults plus the launch's overrides), or read from a
resolved YAML file (merged over those defaults). Each role's engine and model configs are then
built through verl's own conversions (``omega_conf_to_dataclass``: the actor and reference
config classes this project's patch set makes accept ``prefix_grouper``, and verl's
``HFModelConfig``), with the settings verl's worker copies from the model section into the
engine config. The verdict of each role is the sharing engine's own
:meth:`.engine.SharingEngineMixin.setup_problems` - the function its constructor raises from -
so the two cannot disagree. No model is built and no device is touched.

Roles: the actor; the reference model when verl's ``need_reference_policy`` says so; the critic
when ``need_critic`` does (a value model, checked by the sharing value-model engine with the
critic section's own ``use_prefix_grouper`` / ``prefix_grouper``); the model of the SFT trainer
(the keys in its ``engine`` section). A role that does not ask for sharing is checked with the
actor's sharing options (the SFT model: ``arbitrary_prefix``), to say what it would get.

The model's HF config comes from ``model.path`` when it is a local directory, else from
``model_config_dir`` (the command's ``--model-config``), else from the model family guessed
from the name (transformers' defaults for that family: :func:`family_from_name`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import tempfile
from typing import Any

from ..config import PrefixSharingConfig
from ..refusals import Refused
from .config import ATTRIBUTE

__all__ = ["RoleVerdict", "Preflight", "compose_config", "load_config", "preflight",
           "family_from_name", "ENGINE_MODULES"]

# verl's engine modules, by strategy, whose import registers (and patches) the engine
ENGINE_MODULES = {
    "fsdp": "verl.workers.engine.fsdp.transformer_impl",
    "fsdp2": "verl.workers.engine.fsdp.transformer_impl",
    "megatron": "verl.workers.engine.megatron.transformer_impl",
}
# HF model types guessed from a hub name, most specific first (lower-cased name)
_FAMILIES = (
    (r"qwen3\.?5.*(-a\d+b|moe)", "qwen3_5_moe"), (r"qwen3\.?5", "qwen3_5"),
    (r"qwen3-?next", "qwen3_next"),
    (r"qwen3-?vl.*(-a\d+b|moe)", "qwen3_vl_moe"), (r"qwen3-?vl", "qwen3_vl"),
    (r"qwen2\.?5-?vl", "qwen2_5_vl"), (r"qwen2-?vl", "qwen2_vl"),
    (r"qwen3.*(-a\d+b|moe)", "qwen3_moe"), (r"qwen3", "qwen3"), (r"qwen2", "qwen2"),
    (r"deepseek-?v3|moonlight", "deepseek_v3"), (r"gpt-oss", "gpt_oss"),
    (r"nemotron-h", "nemotron_h"), (r"mistral", "mistral"), (r"llama", "llama"),
)


@dataclasses.dataclass
class RoleVerdict:
    """One role: its ``engine`` (verl's strategy), whether its config ``asked`` for sharing,
    the settings refused (``problems``: empty when sharing applies) and a ``note``."""

    role: str
    engine: str
    asked: bool
    problems: list[Refused]
    note: str = ""
    # what the check read: the sharing engine class (None: not a sharing engine) and the
    # configs it would be built from (model, engine, optim, checkpoint)
    engine_cls: type | None = dataclasses.field(default=None, repr=False)
    configs: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def served(self) -> bool:
        return not self.problems


@dataclasses.dataclass
class Preflight:
    """The verdicts of a launch, and where the model config came from (``model_note``)."""

    roles: list[RoleVerdict]
    model_note: str

    @property
    def refused(self) -> bool:
        """Whether a role that asked for sharing is refused."""
        return any(role.asked and not role.served for role in self.roles)


def verl_config_dir() -> str:
    import verl

    return os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def compose_config(overrides: list[str], config_name: str = "ppo_trainer") -> Any:
    """verl's trainer config ``config_name`` composed with ``overrides`` (hydra, verl's
    config directory)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def load_config(path: str) -> Any:
    """A resolved trainer config file, over verl's defaults of its kind (PPO with the
    Megatron or FSDP defaults by the actor's strategy, or SFT)."""
    from omegaconf import OmegaConf

    loaded = OmegaConf.load(path)
    if "actor_rollout_ref" in loaded:
        strategy = OmegaConf.select(loaded, "actor_rollout_ref.actor.strategy")
        name = "ppo_megatron_trainer" if strategy == "megatron" else "ppo_trainer"
    else:
        name = "sft_trainer_engine"
    return OmegaConf.merge(compose_config([], name), loaded)


def family_from_name(name: str) -> str | None:
    """The HF model type a hub name suggests (``Qwen/Qwen2.5-VL-7B-Instruct`` ->
    ``qwen2_5_vl``), or None."""
    lowered = name.rstrip("/").rsplit("/", 1)[-1].lower()
    return next((family for pattern, family in _FAMILIES if re.search(pattern, lowered)), None)


def model_source(path: str, model_config_dir: str | None) -> tuple[str, str]:
    """A local directory holding the model's HF config, and a sentence saying where it came
    from. ``ValueError`` when there is none."""
    if model_config_dir is not None:
        if not os.path.isdir(model_config_dir):
            raise ValueError(f"--model-config {model_config_dir}: not a directory")
        return model_config_dir, f"the HF config in {model_config_dir} (--model-config)"
    local = os.path.expanduser(str(path))
    if os.path.isdir(local):
        return local, f"the HF config of the local checkpoint {local}"
    family = family_from_name(str(path))
    if family is None:
        raise ValueError(f"model.path {path!r} is not a local directory and names no model "
                         "family known here; pass --model-config DIR (a directory with the "
                         "model's config.json)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(family)
    except ValueError as error:
        raise ValueError(f"model.path {path!r}: this transformers has no {family!r} config "
                         f"({error}); pass --model-config DIR") from error
    config.architectures = [_architecture(family)]  # verl asserts one
    directory = tempfile.mkdtemp(prefix="prefix-sharing-preflight-")
    config.save_pretrained(directory)
    return directory, (f"transformers' default {family} config: the family is taken from the "
                       f"name {path!r}, which cannot be read here (pass --model-config DIR for "
                       "the checkpoint's own)")


def _architecture(family: str) -> str:
    """The model class transformers' auto mappings give ``family`` (a VLM's first)."""
    from transformers.models.auto import modeling_auto

    for mapping in ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"):
        name = getattr(modeling_auto, mapping, {}).get(family)
        if name:
            return name
    return "AutoModelForCausalLM"


def preflight(config: Any, model_config_dir: str | None = None) -> Preflight:
    """The verdict of every role of the composed trainer ``config`` (see the module doc)."""
    import prefix_sharing  # noqa: F401  (the patch sets: verl's config classes accept ours)

    if "actor_rollout_ref" in config:
        return _ppo(config, model_config_dir)
    if "model" in config and "engine" in config:
        return _sft(config, model_config_dir)
    raise ValueError("not a verl trainer config: no actor_rollout_ref (PPO) or model + engine "
                     "(SFT) section")


def _ppo(config: Any, model_config_dir: str | None) -> Preflight:
    from omegaconf import open_dict
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass

    section = config.actor_rollout_ref
    directory, note = model_source(section.model.path, model_config_dir)
    model = _model_config(section.model, directory)
    actor = omega_conf_to_dataclass(section.actor)
    actor_sharing = PrefixSharingConfig.from_verl(section.actor)
    roles = [_verdict("actor", section.actor.strategy, model, actor.engine, actor_sharing,
                      actor_sharing, optim=actor.optim, checkpoint=actor.checkpoint)]
    if need_reference_policy(config):
        ref_section = copy.deepcopy(section.ref)
        with open_dict(ref_section):  # what verl's worker does before converting it
            ref_section.ppo_mini_batch_size = section.actor.ppo_mini_batch_size
            ref_section.ppo_micro_batch_size = ref_section.pop("log_prob_micro_batch_size", None)
            ref_section.ppo_micro_batch_size_per_gpu = ref_section.pop(
                "log_prob_micro_batch_size_per_gpu", None)
            ref_section.use_dynamic_bsz = ref_section.pop("log_prob_use_dynamic_bsz", False)
            ref_section.ppo_max_token_len_per_gpu = ref_section.pop(
                "log_prob_max_token_len_per_gpu", None)
        ref = omega_conf_to_dataclass(ref_section)
        ref_model = copy.deepcopy(model)
        ref_model.mtp = type(model.mtp)(enable=False)  # as verl's worker, for the reference
        ref_sharing = PrefixSharingConfig.from_verl(ref_section)
        note_ref = "" if ref_sharing.enabled else (
            "actor_rollout_ref.ref has no use_prefix_grouper of its own (configs/verl/ sets "
            "it to the actor's)")
        roles.append(_verdict("reference", ref_section.strategy, ref_model, ref.engine,
                              ref_sharing, actor_sharing, note_ref, optim=ref.optim,
                              checkpoint=ref.checkpoint))
    if need_critic(config):
        critic_section = copy.deepcopy(config.critic)
        with open_dict(critic_section):  # its model would be loaded: the actor's is read instead
            critic_section.model = None
        critic = omega_conf_to_dataclass(critic_section)  # as verl's trainer converts it
        critic_model = copy.deepcopy(model)
        critic_model.model_type = "value_model"
        roles.append(_verdict("critic", config.critic.strategy, critic_model, critic.engine,
                              PrefixSharingConfig.from_verl(config.critic), actor_sharing,
                              optim=critic.optim, checkpoint=critic.checkpoint))
    return Preflight(roles, note)


def _sft(config: Any, model_config_dir: str | None) -> Preflight:
    from verl.utils.config import omega_conf_to_dataclass

    directory, note = model_source(config.model.path, model_config_dir)
    model = _model_config(config.model, directory)
    engine = omega_conf_to_dataclass(config.engine)
    sharing = PrefixSharingConfig.from_verl(config.engine)
    note_sft = "" if sharing.enabled else "engine.use_prefix_grouper is not set"
    # the megatron engine section names no strategy: the dataclass has it ("megatron")
    verdict = _verdict("sft", engine.strategy, model, engine, sharing,
                       PrefixSharingConfig(mode="arbitrary_prefix"), note_sft)
    if sharing.mode == "prompt_only":  # what the engine's first micro-batch raises
        verdict.problems.append(Refused("verl.prompt_uids", "prefix_grouper.mode=prompt_only "
                                        "(use_prefix_grouper without a mode) in the SFT "
                                        "trainer, whose samples carry no uid"))
    return Preflight([verdict], note)


def _model_config(section: Any, directory: str) -> Any:
    """verl's ``HFModelConfig`` of the model section, its HF config read from ``directory``
    (no tokenizer)."""
    from omegaconf import OmegaConf, open_dict
    from verl.utils.config import omega_conf_to_dataclass

    section = copy.deepcopy(section)
    with open_dict(section):
        section.path = directory
        section.hf_config_path = None
        section.tokenizer_path = None
        section.load_tokenizer = False
        section.external_lib = None
        if "_target_" not in section:
            section._target_ = "verl.workers.config.HFModelConfig"
    model = omega_conf_to_dataclass(OmegaConf.create(OmegaConf.to_container(section)))
    model.model_type = "language_model"
    return model


def _verdict(role: str, strategy: str, model: Any, engine_config: Any,
             sharing: PrefixSharingConfig, actor_sharing: PrefixSharingConfig,
             note: str = "", **configs: Any) -> RoleVerdict:
    """The role's refusals from its sharing engine's ``setup_problems``, checked with its own
    sharing options or, when it asks for none, the actor's (or ``arbitrary_prefix``)."""
    import importlib

    # what verl's worker copies from the model section into the engine config
    engine_config.use_remove_padding = model.get("use_remove_padding", False)
    engine_config.use_fused_kernels = model.get("use_fused_kernels", False)
    checked = sharing if sharing.enabled else (
        actor_sharing if actor_sharing.enabled else PrefixSharingConfig(mode="arbitrary_prefix"))
    # as the actor config's __post_init__ attaches it (verl's BaseConfig freezes an attribute
    # once set; these configs were built for this check only)
    object.__setattr__(engine_config, ATTRIBUTE, checked)
    engine_cls = None
    if strategy in ENGINE_MODULES:
        importlib.import_module(ENGINE_MODULES[strategy])
        engine_cls = sharing_engine(strategy, model.model_type)
    else:  # an engine refused by name (its verl module may need a package not installed here)
        from .unhooked import refusal_for

        engine_cls = refusal_for(strategy)
    if engine_cls is None:
        problems = [Refused("cli.unpatched_engine", f"strategy={strategy}")]
    else:
        problems = engine_cls.setup_problems(model, engine_config)
    return RoleVerdict(role, strategy, sharing.enabled, problems, note, engine_cls,
                       dict(model=model, engine=engine_config, **configs))


def sharing_engine(strategy: str, model_type: str = "language_model") -> type | None:
    """The ``model_type`` engine verl selects for ``strategy`` on a GPU
    (:func:`.engine.registered_engine`) when it is a sharing one (this project's patch set
    registered it), else None."""
    from .engine import registered_engine

    try:
        engine_cls = registered_engine(model_type, strategy)
    except KeyError:  # verl registered no engine for this backend on a GPU
        return None
    return engine_cls if hasattr(engine_cls, "setup_problems") else None
