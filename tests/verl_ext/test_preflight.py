"""``prefix-sharing preflight`` says what the engines say: for each setting, the actor's
verdict (the refusal keys, or none) equals what constructing verl's registered sharing engine
from the same configs raises - on the FSDP and Megatron engines, whichever way a check goes.
The settings that stay refused (MTP training, LoRA or a vision model on the Megatron engine,
the VeOmni engine) pin the verdicts' content, and the critic (a value model) is served; the command's exit status is 0 / 1 / 2 for served /
refused / bad input, from overrides and from a launch script."""

import importlib.util
import re

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.cli import main  # noqa: E402
from prefix_sharing.engines.launch import run_distributed  # noqa: E402

BASE = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_prefix_grouper=true",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]
FSDP = ["actor_rollout_ref.actor.strategy=fsdp2"]
MEGATRON = "ppo_megatron_trainer"
MODEL = "actor_rollout_ref.model."
MTP_TRAIN = [MODEL + "mtp.enable=true", MODEL + "mtp.enable_train=true"]
CROSS = ["+actor_rollout_ref.actor.prefix_grouper={mode: arbitrary_prefix, "
         "cross_micro_batch: true}"]
# name -> (verl's config, overrides beyond BASE and the model path); "vlm" rows name a hub VLM
ROWS = {
    "fsdp2": ("ppo_trainer", FSDP),
    "fsdp1": ("ppo_trainer", ["actor_rollout_ref.actor.strategy=fsdp"]),
    "padded": ("ppo_trainer", FSDP + [MODEL + "use_remove_padding=false"]),
    "fused": ("ppo_trainer", FSDP + [MODEL + "use_fused_kernels=true"]),
    "ulysses": ("ppo_trainer", FSDP + ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]),
    "mtp": ("ppo_trainer", FSDP + MTP_TRAIN),
    "fsdp_lora": ("ppo_trainer", FSDP + [MODEL + "lora_rank=8"]),
    "fsdp_vlm": ("ppo_trainer", FSDP + [MODEL + "path=Qwen/Qwen2.5-VL-7B-Instruct"]),
    "megatron": (MEGATRON, []),
    "megatron_lora": (MEGATRON, [MODEL + "lora.rank=8"]),
    "megatron_vlm": (MEGATRON, [MODEL + "path=Qwen/Qwen2.5-VL-7B-Instruct"]),
    "megatron_mtp": (MEGATRON, MTP_TRAIN),
    "fsdp_cross": ("ppo_trainer", FSDP + CROSS),
    "fsdp_vlm_cross": ("ppo_trainer", FSDP + CROSS + [
        MODEL + "path=Qwen/Qwen2.5-VL-7B-Instruct"]),
    "megatron_cross": (MEGATRON, CROSS),
}
OVERRIDE = "+actor_rollout_ref.actor.megatron.override_transformer_config."
# Megatron rows whose model the sharing layers check when it is built, each verdict said at
# construction (name -> (overrides, the model's HF config: a transformers model type and fields
# set on it, the refusal key or None where it builds))
BUILD_ROWS = {
    "megatron_mla_rope_fusion": ([OVERRIDE + "apply_rope_fusion=true"],
                                 ("deepseek_v3", {}), "megatron.rope_fusion"),
    "megatron_mtp_layers": ([MODEL + "mtp.enable=true"],  # MTP layers built, not trained
                            ("qwen2", {"num_nextn_predict_layers": 1}), None),
    "megatron_mtp_trained": (MTP_TRAIN, ("qwen2", {"num_nextn_predict_layers": 2}), None),
    "megatron_mtp_repeated_layer": (MTP_TRAIN + [OVERRIDE + "mtp_use_repeated_layer=true"],
                                    ("qwen2", {"num_nextn_predict_layers": 2}),
                                    "megatron.mtp"),
    "megatron_window": ([OVERRIDE + "window_size=[8,2]"], ("qwen2", {}),
                        "megatron.window_reads_later_keys"),
    "megatron_moe_cp_per_token_loss": (
        ["actor_rollout_ref.actor.megatron.context_parallel_size=2",
         OVERRIDE + "calculate_per_token_loss=true"], ("qwen3_moe", {}),
        "megatron.context_parallel.moe_per_token_loss"),
}
# the keys with which verl's engine refuses a model before any other (setup_problems)
MOOT_MAKERS = {"verl.megatron_vlm", "verl.gdn_release", "verl.megatron_lora"}


def model_build_keys(model_config, engine_config) -> tuple[str, ...] | None:
    """The keys building a tiny GPT model with the sharing layer spec raises, its
    ``TransformerConfig`` holding the fields verl's bridge would give this model
    (``transformer_config_view``), set on a built config: megatron's own validation of DSA,
    MLA and MTP asks for sizes that do not change what is refused. None for a hybrid stack
    (megatron-core 0.18+: tests/megatron_ext/test_hybrid.py builds those)."""
    from megatron.core.models.gpt import GPTModel

    from prefix_sharing.engines.megatron_models import transformer_config
    from prefix_sharing.megatron_ext import (UnsupportedSetupError, check_sharing_model,
                                             get_gpt_layer_local_spec,
                                             share_multi_token_prediction)
    from prefix_sharing.presets import PRESETS
    from prefix_sharing.verl_ext.mcore_model import hybrid_pattern, transformer_config_view

    if hybrid_pattern(model_config.hf_config) is not None:
        return None
    preset = PRESETS["tiny"]
    config = transformer_config(preset)
    for name, value in vars(transformer_config_view(model_config, engine_config)).items():
        setattr(config, name, value)
    try:
        layer_spec = get_gpt_layer_local_spec()
        mtp = None
        if config.mtp_num_layers:  # stock MTP layers around the sharing layer, as the bridge
            from megatron.core.transformer.multi_token_prediction import (  # builds them
                MultiTokenPredictionBlockSubmodules, get_mtp_layer_spec)
            mtp = MultiTokenPredictionBlockSubmodules(layer_specs=[get_mtp_layer_spec(
                layer_spec, use_transformer_engine=False)] * config.mtp_num_layers)
        model = GPTModel(config=config, transformer_layer_spec=layer_spec, mtp_block_spec=mtp,
                         vocab_size=preset.vocab_size,
                         max_sequence_length=preset.max_sequence_length)
        if mtp is not None:  # the sharing engine's initialize() (share_verl_mtp)
            share_multi_token_prediction(model)
        check_sharing_model(model)
    except UnsupportedSetupError as error:  # megatron's build_module re-raises it by message
        return tuple(sorted(set(re.findall(r"\[([\w.]+)\]", str(error)))))
    return ()


def config_dir(root: str, model_type: str, fields: dict) -> str:
    """transformers' default config of ``model_type`` with ``fields``, saved under ``root``."""
    import os

    from transformers import AutoConfig

    from prefix_sharing.verl_ext.preflight import _architecture

    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [_architecture(model_type)]
    path = os.path.join(root, "-".join([model_type, *fields]))
    config.save_pretrained(path)
    return path
# rows whose engine needs more ranks than this test has: Ulysses at 2 (served; built at 2 and 4
# ranks by tests/verl_ext/test_fsdp_ulysses.py)
BUILT_ELSEWHERE = ("ulysses",)


def verdicts_and_constructions(rank: int, path: str, config_root: str) -> dict:
    """Per row: the actor's preflight keys, and the keys the engine's construction raises
    (``()`` when it builds) from the configs preflight read, and (Megatron) building the model;
    the critic's keys under GAE."""
    from prefix_sharing.errors import PrefixSharingSetupError
    from prefix_sharing.verl_ext.preflight import compose_config, preflight
    from tests.verl_ext._batch import use_cpu_platform

    use_cpu_platform()
    found = {}
    rows = {name: (config_name, [MODEL + f"path={path}"] + overrides)
            for name, (config_name, overrides) in ROWS.items()}
    rows.update({name: (MEGATRON, overrides + [
        MODEL + f"path={config_dir(config_root, model_type, fields)}"])
        for name, (overrides, (model_type, fields), _) in BUILD_ROWS.items()})
    for name, (config_name, overrides) in rows.items():
        config = compose_config(BASE + overrides, config_name)
        actor = preflight(config).roles[0]
        built = ()
        if actor.engine_cls is not None and name not in BUILT_ELSEWHERE:
            c = actor.configs
            try:
                actor.engine_cls(c["model"], c["engine"], c["optim"], c["checkpoint"])
            except PrefixSharingSetupError as error:
                built = error.refusals
        found[name] = {"preflight": tuple(p.key for p in actor.problems), "built": built,
                       "engine": actor.engine_cls.__name__ if actor.engine_cls else None}
        if config_name == MEGATRON:
            found[name]["model_built"] = model_build_keys(actor.configs["model"],
                                                          actor.configs["engine"])
    gae = [MODEL + f"path={path}", "algorithm.adv_estimator=gae",
           "critic.ppo_micro_batch_size_per_gpu=2"]
    for name, critic in (("critic", []),
                         ("critic_sharing", ["+critic.use_prefix_grouper=true",
                                             "+critic.prefix_grouper={mode: arbitrary_prefix}",
                                             "critic.strategy=fsdp2"])):
        roles = preflight(compose_config(BASE + FSDP + gae + critic)).roles
        found[name] = [(r.role, r.asked, tuple(p.key for p in r.problems)) for r in roles]
    critic = roles[-1]  # the sharing critic: built from the configs preflight read
    c = critic.configs
    found["critic_built"] = (type(critic.engine_cls(c["model"], c["engine"], c["optim"],
                                                    c["checkpoint"])).__name__)
    veomni = preflight(compose_config(BASE + gae + ["model_engine=veomni",
                                                   "+critic.use_prefix_grouper=true"]))
    found["veomni"] = [(r.role, r.asked, tuple(p.key for p in r.problems)) for r in veomni.roles]
    return found


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.verl_ext._fsdp_engine import save_model

    return save_model(str(tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="module")
def rows(checkpoint, tmp_path_factory):
    return run_distributed(verdicts_and_constructions, 1, checkpoint,
                           str(tmp_path_factory.mktemp("configs")), timeout=500)[0]


@pytest.mark.parametrize("row", [name for name in [*ROWS, *BUILD_ROWS]
                                 if name != "fsdp1" and name not in BUILT_ELSEWHERE])
def test_preflight_says_what_constructing_the_engine_raises(rows, row):
    assert rows[row]["engine"] in ("PrefixSharingFSDPEngine", "PrefixSharingMegatronEngine")
    assert rows[row]["preflight"] == rows[row]["built"], rows[row]


@pytest.mark.parametrize("row", list(BUILD_ROWS))
def test_the_models_build_does_what_preflight_said(rows, row):
    """Each condition the sharing layers check when they are built: preflight gives its key,
    and building the model from the same configs raises that key; where preflight serves
    (MTP layers, trained or not), the model builds."""
    key = BUILD_ROWS[row][2]
    expected = () if key is None else (key,)
    assert rows[row]["preflight"] == expected
    assert rows[row]["model_built"] == expected


@pytest.mark.parametrize("row", ["megatron", "megatron_mtp"])
def test_a_megatron_model_preflight_serves_builds(rows, row):
    """What preflight passes, the model's build passes (MTP training asked of a model without
    MTP layers: verl's own error, at its build). The LoRA and VLM rows are refused before the
    model is built (``MOOT_MAKERS``)."""
    assert rows[row]["model_built"] == tuple(
        k for k in rows[row]["preflight"] if k.startswith("megatron.")) == ()


def test_fsdp1_is_checked_by_the_same_engine_class_as_fsdp2(rows):
    """FSDP1 cannot be constructed on CPU; its registered engine is the same sharing class."""
    assert rows["fsdp1"]["engine"] == "PrefixSharingFSDPEngine"
    assert rows["fsdp1"]["preflight"] == rows["fsdp2"]["preflight"]


def test_the_settings_that_stay_refused_are_named_and_the_plain_ones_served(rows):
    assert rows["fsdp2"]["preflight"] == () and rows["megatron"]["preflight"] == ()
    assert rows["ulysses"]["preflight"] == ()  # served on the FSDP engine
    # groups across micro-batches on a dense model, both engines (tests/verl_ext/test_fsdp_cross
    # and test_cross_forward); a recurrent model's refusal: test_engine.py
    assert rows["fsdp_cross"]["preflight"] == rows["megatron_cross"]["preflight"] == ()
    assert "verl.mtp" in rows["mtp"]["preflight"]  # the FSDP engine trains no MTP layers
    assert rows["megatron_mtp"]["preflight"] == ()  # tests/verl_ext/test_mcore_mtp.py
    assert rows["megatron_lora"]["preflight"] == ("verl.megatron_lora",)
    assert rows["fsdp_lora"]["preflight"] == ()  # served: tests/verl_ext/test_fsdp_lora.py
    assert rows["megatron_vlm"]["preflight"] == ("verl.megatron_vlm",)
    # Qwen2.5-VL, a family of the FSDP engine's: served where transformers is new enough
    from prefix_sharing.fsdp_compat.vlm import vlm_release_problem

    release = () if vlm_release_problem("qwen2_5_vl") is None else ("hf.vlm_release",)
    assert rows["fsdp_vlm"]["preflight"] == release
    # a block's forward takes no images: groups across micro-batches refused at construction
    assert "verl.multimodal" in rows["fsdp_vlm_cross"]["preflight"]


def test_the_critic_is_served_and_says_whether_it_asked(rows):
    """The critic's own keys (``critic.use_prefix_grouper``); without them it is checked with
    the actor's options, to say what it would get: served either way."""
    roles = dict((role, (asked, keys)) for role, asked, keys in rows["critic"])
    assert roles["actor"] == (True, ()) and roles["critic"] == (False, ())
    roles = dict((role, (asked, keys)) for role, asked, keys in rows["critic_sharing"])
    assert roles["critic"] == (True, ())
    assert rows["critic_built"] == "PrefixSharingFSDPValueEngine"  # constructing it raised nothing


def test_the_veomni_engine_is_refused_by_name_for_every_role_that_asks(rows):
    assert rows["veomni"] == [("actor", True, ("verl.unhooked_engine",)),
                              ("critic", True, ("verl.unhooked_engine",))]


def test_the_command_exits_0_served_1_refused_2_bad_input(checkpoint, tmp_path, capsys):
    served = BASE + FSDP + [MODEL + f"path={checkpoint}"]
    assert main(["preflight", "--", *served]) == 0
    assert main(["preflight", "--", *served, MODEL + "mtp.enable=true",
                 MODEL + "mtp.enable_train=true"]) == 1
    out = capsys.readouterr().out
    assert "[verl.mtp]" in out and "set model.mtp.enable_train=False" in out
    assert main(["preflight", "--", *served, "actor_rollout_ref.no_such_key=1"]) == 2
    script = tmp_path / "run.sh"
    script.write_text("MODEL=" + checkpoint + "\npython3 -m verl.trainer.main_ppo \\\n    "
                      + " \\\n    ".join(BASE + FSDP) + " \\\n    "
                      + "actor_rollout_ref.model.path=$MODEL \"$@\"\n")
    assert main(["preflight", "--script", str(script)]) == 0
    assert main(["preflight", "--script", str(script), "--",
                 "actor_rollout_ref.actor.attention_dropout=0.1"]) == 2  # not verl's key
    assert main(["preflight", "--script", str(script), "--", MODEL + "mtp.enable=true",
                 MODEL + "mtp.enable_train=true"]) == 1


def test_the_sft_trainers_model_asks_for_nothing_and_is_checked_as_it_would_share(checkpoint):
    from prefix_sharing.verl_ext.preflight import compose_config, preflight

    served = preflight(compose_config([f"model.path={checkpoint}"], "sft_trainer_engine"))
    assert [(r.role, r.engine, r.asked, r.problems) for r in served.roles] == [
        ("sft", "fsdp", False, [])]
    assert not served.refused
    padded = preflight(compose_config([f"model.path={checkpoint}", "model.use_remove_padding=false",
                                       "model.use_fused_kernels=true"], "sft_trainer_engine"))
    keys = [p.key for p in padded.roles[0].problems]
    with_sharing = padded.roles[0].engine_cls.setup_problems(padded.roles[0].configs["model"],
                                                             padded.roles[0].configs["engine"])
    assert keys == [p.key for p in with_sharing] and not padded.refused  # it did not ask


SFT_SHARING = ["+engine.use_prefix_grouper=true", "+engine.prefix_grouper.mode=arbitrary_prefix"]


@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_the_sft_trainers_engine_section_asks_with_the_actors_keys(checkpoint, engine):
    from prefix_sharing.config import PrefixSharingConfig
    from prefix_sharing.verl_ext.preflight import compose_config, preflight

    asked = preflight(compose_config([f"model.path={checkpoint}", f"engine={engine}",
                                      *SFT_SHARING], "sft_trainer_engine"))
    role = asked.roles[0]
    assert (role.role, role.engine, role.asked, role.problems) == ("sft", engine, True, [])
    assert role.configs["engine"].prefix_sharing == PrefixSharingConfig(mode="arbitrary_prefix")
    # a setting each engine refuses: MTP training on FSDP (served on Megatron), dynamic CP
    unserved = {"fsdp": ["model.mtp.enable=true", "model.mtp.enable_train=true"],
                "megatron": ["engine.dynamic_context_parallel=true",
                             "engine.max_seqlen_per_dp_cp_rank=64"]}[engine]
    refused = preflight(compose_config([f"model.path={checkpoint}", f"engine={engine}",
                                        *unserved, *SFT_SHARING], "sft_trainer_engine"))
    assert refused.roles[0].asked and refused.roles[0].problems and refused.refused
    # use_prefix_grouper alone means prompt_only, which needs the uids SFT samples lack (the
    # engine raises it at its first micro-batch: tests/verl_ext/test_sft_engine.py)
    prompt_only = preflight(compose_config([f"model.path={checkpoint}", f"engine={engine}",
                                            "+engine.use_prefix_grouper=true"],
                                           "sft_trainer_engine"))
    assert [p.key for p in prompt_only.roles[0].problems] == ["verl.prompt_uids"]


def test_an_actors_engine_section_that_asks_keeps_its_own_and_a_different_actor_request_fails():
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    import prefix_sharing  # noqa: F401  (the config classes accept the keys)

    def actor(**section):
        engine = dict(_target_="verl.workers.config.FSDPEngineConfig", use_prefix_grouper=True,
                      prefix_grouper={"mode": "arbitrary_prefix"})
        return omega_conf_to_dataclass(OmegaConf.create(dict(
            _target_="verl.workers.config.FSDPActorConfig", strategy="fsdp2", rollout_n=1,
            ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1, fsdp_config=engine,
            optim=dict(_target_="verl.workers.config.FSDPOptimizerConfig"), **section)))

    assert actor().engine.prefix_sharing.mode == "arbitrary_prefix"
    with pytest.raises(Exception, match="set it in one of them"):  # hydra wraps the ValueError
        actor(use_prefix_grouper=True, prefix_grouper={"mode": "prompt_only"})
