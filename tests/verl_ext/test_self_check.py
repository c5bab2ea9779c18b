"""``prefix_grouper.self_check: true`` in verl's real engines (FSDP2 and Megatron, whichever
supported verl is installed: 0.9.1 or 0.8.0).

Per engine, on the tiny fp32 model and a GRPO batch: the first sharing micro-batch also runs
verl's stock path; the figures are logged once and reach that call's metrics; the training
step (verl's ``ppo_loss`` outputs, every gradient), later calls' outputs and the RNG state are
bit-identical to the same calls with the check off; a shared path that is deliberately broken
(a perturbed attention kernel in FSDP, perturbed log-probs in Megatron) raises with the
figures. In bf16 (FSDP's autocast on CPU) the check passes within its bf16 bound. The first
call is the update (``forward_backward_batch``), so the check runs with
gradients enabled, in verl's train mode; the broken runs start with ``infer_batch``. Setups
the check cannot serve refuse it: an FSDP model with recurrent layers; in Megatron, pipeline or
context parallelism and router replay.
"""

import contextlib
import logging
from functools import partial

import pytest
import torch

from tests.verl_ext._requires import require_verl

require_verl(("0.9.1", "0.8.0"))

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from prefix_sharing.self_check import SelfCheckFailed  # noqa: E402
from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._batch import make_batch, plain_output, use_cpu_platform  # noqa: E402

SHARE = {"mode": "arbitrary_prefix", "min_prefix_len": 1}
CHECKED = {**SHARE, "self_check": True}
BF16 = {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
REFUSED_MEGATRON = {
    "pipeline_model_parallel_size=2": {"pipeline_model_parallel_size": 2},
    "context_parallel_size=2": {"context_parallel_size": 2},
    "router_replay.mode='R3'": {"router_replay": {
        "_target_": "verl.workers.config.EngineRouterReplayConfig", "mode": "R3"}},
}
METRICS = ("prefix_sharing/self_check_max_abs_diff", "prefix_sharing/self_check_max_rel_diff",
           "prefix_sharing/self_check_bound")


@contextlib.contextmanager
def logged_checks():
    """The self-check's log messages during the block."""
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("prefix_sharing.verl_ext.self_check")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def steps(update, infer) -> dict:
    """An update, an inference call, another update (seeded alike for every engine), and
    what the check logged meanwhile."""
    torch.manual_seed(0)
    with logged_checks() as messages:
        first = update()
        infer_output = plain_output(infer())
        second = update()
    return {"first": first, "infer": infer_output, "second": second, "log": messages,
            "rng": torch.random.get_rng_state()}


def broken_run(infer) -> str:
    try:
        infer()
    except SelfCheckFailed as error:
        return str(error)
    return "(not raised)"


def fsdp_rank(rank: int, path: str, hybrid_path: str | None) -> dict:
    from transformers import AttentionInterface
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.fsdp_compat.attention import (ATTENTION_NAME, prefix_sharing_attention,
                                                      register_attention)
    from prefix_sharing.fsdp_compat.fsdp import full_gradients
    from prefix_sharing.verl_ext.mcore import PrefixSharingSetupError
    from tests.verl_ext._fsdp_engine import actor_config, build_engine

    use_cpu_platform()
    results = {}
    for name, block in (("off", SHARE), ("on", CHECKED)):
        config = actor_config(block)
        engine = build_engine(config, path)

        def update():
            with engine.train_mode():  # zeroes the gradients on exit: gather them before
                output = engine.forward_backward_batch(make_batch("grpo"),
                                                       partial(ppo_loss, config=config))
                return {"output": plain_output(output), "grads": full_gradients(engine.module)}

        def infer():
            with engine.eval_mode():
                return engine.infer_batch(make_batch("grpo"))

        results[name] = steps(update, infer)

    def perturbed(*args, **kwargs):  # a kernel bug: the sharing attention's output off by 5%
        output, weights = prefix_sharing_attention(*args, **kwargs)
        return output * 1.05, weights

    config = actor_config(CHECKED, mixed_precision=BF16)  # verl's autocast: bf16 both paths
    engine = build_engine(config, path)
    with logged_checks() as results["bf16"], engine.eval_mode():
        engine.infer_batch(make_batch("grpo"))

    engine = build_engine(actor_config(CHECKED), path)
    AttentionInterface.register(ATTENTION_NAME, perturbed)
    try:
        with engine.eval_mode():
            results["broken"] = broken_run(lambda: engine.infer_batch(make_batch("grpo")))
    finally:
        register_attention()

    if hybrid_path is not None:
        try:
            build_engine(actor_config(CHECKED), hybrid_path)
            results["hybrid"] = "(not refused)"
        except PrefixSharingSetupError as error:
            results["hybrid"] = str(error)
    return results


def megatron_rank(rank: int) -> dict:
    import prefix_sharing.megatron_ext as megatron_ext
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.verl_ext.engine import registered_engine
    from prefix_sharing.verl_ext.mcore import PrefixSharingSetupError
    from tests.verl_ext._engine import actor_config, build_engine

    use_cpu_platform()
    results = {}
    for name, block in (("off", SHARE), ("on", CHECKED)):
        config = actor_config(block)
        engine = build_engine(config)

        def update():
            output = engine.forward_backward_batch(make_batch("grpo"),
                                                   partial(ppo_loss, config=config))
            grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
            engine.module[0].zero_grad()
            return {"output": plain_output(output), "grads": grads}

        results[name] = steps(update, lambda: engine.infer_batch(make_batch("grpo")))

    stock_stats = megatron_ext.token_stats

    def perturbed(*args, **kwargs):  # a restore bug: every shared log-prob off by 0.5
        stats = stock_stats(*args, **kwargs)
        return stats._replace(log_probs=stats.log_probs + 0.5)

    engine = build_engine(actor_config(CHECKED))
    megatron_ext.token_stats = perturbed
    try:
        results["broken"] = broken_run(lambda: engine.infer_batch(make_batch("grpo")))
    finally:
        megatron_ext.token_stats = stock_stats

    engine_cls = registered_engine("language_model", "megatron")
    results["refused"] = {}
    for name, megatron in REFUSED_MEGATRON.items():
        config = actor_config(CHECKED, megatron=megatron)
        try:
            engine_cls(None, config.engine, config.optim, config.checkpoint)
            results["refused"][name] = "(not refused)"
        except PrefixSharingSetupError as error:
            results["refused"][name] = str(error)
    return results


def hybrid_family() -> str | None:
    """A Gated DeltaNet hybrid family this transformers has (Qwen3.5 or Qwen3-Next), if any."""
    import transformers

    configs = {"qwen3_5_text": "Qwen3_5TextConfig", "qwen3_next": "Qwen3NextConfig"}
    return next((f for f, config in configs.items() if hasattr(transformers, config)), None)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    import dataclasses

    from tests.verl_ext._fsdp_engine import PRESET, save_model

    family = hybrid_family()
    hybrid = None if family is None else save_model(
        str(tmp_path_factory.mktemp(family)), family,
        preset=dataclasses.replace(PRESET, num_layers=4, full_attention_every=4))
    return run_gloo(fsdp_rank, 1, save_model(str(tmp_path_factory.mktemp("qwen2"))), hybrid,
                    timeout=400)[0]


@pytest.fixture(scope="module")
def megatron():
    return run_distributed(megatron_rank, 1, timeout=400)[0]


@pytest.fixture(params=["fsdp", "megatron"])
def engine(request):
    return request.getfixturevalue(request.param)


def test_the_check_passes_and_logs_its_figures_once(engine):
    [message] = engine["on"]["log"]
    assert message.startswith("prefix-sharing self-check (shared vs stock path, torch.float32): "
                              "log_probs: max abs diff ")
    assert "entropy: max abs diff" in message and "within the bound 1.0e-05 relative" in message
    assert engine["off"]["log"] == []


def test_the_figures_reach_the_metrics_of_the_call_that_ran_the_check_only(engine):
    metrics = engine["on"]["first"]["output"]["metrics"]
    abs_diff, rel_diff, bound = (metrics[key] for key in METRICS)
    assert bound == [1e-5] and 0 <= rel_diff[0] <= 1e-5 and 0 <= abs_diff[0] < 1e-4
    assert f"max abs diff {abs_diff[0]:.3e}" in engine["on"]["log"][0]
    for later in (engine["on"]["infer"], engine["on"]["second"]["output"]):
        assert not any(key in later["metrics"] for key in METRICS)
    assert not any(key in engine["off"]["first"]["output"]["metrics"] for key in METRICS)


def test_the_checked_step_equals_the_unchecked_one_bit_for_bit(engine):
    on, off = engine["on"], engine["off"]
    for call in ("first", "second"):
        assert on[call]["output"]["loss"] == off[call]["output"]["loss"], call
        assert on[call]["grads"].keys() == off[call]["grads"].keys()
        for name, grad in off[call]["grads"].items():
            assert torch.equal(on[call]["grads"][name], grad), (call, name)
        for key, values in off[call]["output"]["model_output"].items():
            for s, p in zip(on[call]["output"]["model_output"][key], values, strict=True):
                assert torch.equal(s, p), (call, key)
    for key, values in off["infer"]["model_output"].items():
        assert all(torch.equal(s, p) for s, p in zip(on["infer"]["model_output"][key], values,
                                                     strict=True)), key
    assert torch.equal(on["rng"], off["rng"])


def test_in_bf16_the_fsdp_engines_check_passes_within_torchs_bf16_rtol(fsdp):
    [message] = fsdp["bf16"]
    assert "(shared vs stock path, torch.bfloat16)" in message
    assert "within the bound 1.6e-02 relative" in message


def test_a_broken_sharing_path_raises_with_the_figures(engine):
    message = engine["broken"]
    assert "prefix-sharing self-check (shared vs stock path, torch.float32)" in message, message
    assert "BEYOND the bound 1.0e-05 relative" in message
    assert "max abs diff" in message and "max rel diff" in message


def test_an_fsdp_model_with_recurrent_layers_refuses_the_check(fsdp):
    if "hybrid" not in fsdp:
        pytest.skip("this transformers has no Gated DeltaNet hybrid (Qwen3.5 / Qwen3-Next)")
    assert ("self-check on a recurrent model (prefix_grouper.self_check=true): it compares with "
            "verl's stock path" in fsdp["hybrid"]), fsdp["hybrid"]

    assert "(Gated DeltaNet, Mamba-2); set self_check: false" in fsdp["hybrid"]


@pytest.mark.parametrize("setting", REFUSED_MEGATRON)
def test_megatron_settings_without_a_stock_run_on_the_same_micro_batch_refuse_it(megatron,
                                                                                 setting):
    assert f"(self_check=true with {setting}): its stock run" in megatron["refused"][setting]
