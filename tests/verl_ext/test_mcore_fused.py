"""verl's Megatron engine with ``use_fused_kernels: true`` and ``prefix_grouper`` on: the sharing
engine scores each micro-batch from the hidden states itself, the head run in chunks of rows on
each rank's vocabulary slice (``prefix_sharing.megatron_ext.head_token_stats``), and gives
verl's fused step's results - old log-probs, entropy, ``ppo_loss``, every gradient (fp32, 1e-5)
- and the unfused stock step's, on GRPO and tree batches, at TP=1 and at TP=2 with sequence
parallelism. verl's fused kernel is a CPU stand-in of its documented semantics
(``tests/verl_ext/fake_linear_cross_entropy.py``): the stock fused run must call it, the
sharing run must not (its forward stays unpatched). With ``self_check`` the sharing run's
reference is verl's fused forward on the same micro-batch. Under context parallelism or across
micro-batches the switch is refused (``verl.fused_kernels``)."""

from tests.verl_ext._requires import require_verl

require_verl("0.9.1")

import pytest  # noqa: E402

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402

WORKLOADS = ("grpo", "tree")
CHECKED = {**MODES["arbitrary_prefix"], "self_check": True}


def _job(rank: int, tp: int) -> dict:
    from prefix_sharing.engines.megatron import finalize_sequence_parallel_grads
    from tests.verl_ext._batch import make_batch, use_cpu_platform
    from tests.verl_ext._engine import actor_config, build_engine, step
    from tests.verl_ext.fake_linear_cross_entropy import installed

    use_cpu_platform()
    parallel = dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    found = {}
    for workload in WORKLOADS:
        runs = {"stock_unfused": (None, False), "stock": (None, True),
                "shared": (MODES["arbitrary_prefix"], True)}
        if workload == "tree":
            runs["self_checked"] = (CHECKED, True)
        for name, (prefix_grouper, fused) in runs.items():
            config = actor_config(prefix_grouper, megatron=parallel)
            config.engine.use_fused_kernels = fused
            with installed() as calls:
                engine = build_engine(config, sequence_parallel=tp > 1)
                engine._maybe_enable_fused_kernels()  # as verl's initialize() does
                found[workload, name] = step(engine, config, lambda: make_batch(workload),
                                             finalize=finalize_sequence_parallel_grads)
            found[workload, name]["kernel_calls"] = len(calls)
    found["refused"] = _refused() if tp == 1 else None
    return found


def _refused() -> dict[str, list[str]]:
    """The sharing engine's construction-time refusals with ``use_fused_kernels`` on, per
    setting that the hidden-state head does not cover."""
    from types import SimpleNamespace

    from prefix_sharing.verl_ext.engine import registered_engine
    from tests.verl_ext._engine import actor_config

    engine_cls = registered_engine("language_model", "megatron")
    model = SimpleNamespace(hf_config=SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
                            mtp=SimpleNamespace(enable=False, enable_train=False),
                            model_type="language_model", use_fused_kernels=True)
    settings = {"one_micro_batch": (MODES["arbitrary_prefix"], {}),
                "context_parallel": (MODES["arbitrary_prefix"], dict(context_parallel_size=2)),
                "cross_micro_batch": ({**MODES["arbitrary_prefix"], "cross_micro_batch": True},
                                      {})}
    refused = {}
    for name, (prefix_grouper, megatron) in settings.items():
        config = actor_config(prefix_grouper, megatron=megatron)
        config.engine.use_fused_kernels = True
        refused[name] = [f"{p.key}: {p.detail}"
                         for p in engine_cls.setup_problems(model, config.engine)]
    return refused


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    """Per tensor-parallel size (1, and 2 with sequence parallelism), each rank's results."""
    return {tp: run_distributed(_job, tp, tp, tp=tp, timeout=600) for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("workload", WORKLOADS)
def test_shared_fused_step_equals_verls_fused_and_unfused_steps(runs, tp, workload):
    for rank, found in enumerate(runs[tp]):
        shared = found[workload, "shared"]
        assert shared["kernel_calls"] == 0 and found[workload, "stock"]["kernel_calls"] > 0
        metrics = shared["train"]["metrics"]
        assert metrics["prefix_sharing/tokens_computed"] < metrics["prefix_sharing/tokens_total"]
        for reference in ("stock", "stock_unfused"):
            same_outputs(shared, found[workload, reference], f"rank {rank} {workload} {reference}")


@pytest.mark.parametrize("tp", [1, 2])
def test_the_self_check_runs_verls_fused_forward_as_its_reference(runs, tp):
    for rank, found in enumerate(runs[tp]):
        checked = found["tree", "self_checked"]
        assert checked["kernel_calls"] > 0  # the reference ran verl's fused kernel
        assert "prefix_sharing/self_check_max_rel_diff" in checked["infer"]["metrics"]  # first call
        same_outputs(checked, found["tree", "stock"], f"rank {rank} self-checked")


def test_context_parallelism_and_cross_micro_batch_groups_are_refused_by_name(runs):
    refused = runs[1][0]["refused"]
    assert refused["one_micro_batch"] == []
    assert "verl.fused_kernels: use_fused_kernels=True with context_parallel_size=2" in (
        refused["context_parallel"])
    assert refused["cross_micro_batch"] == [
        "verl.fused_kernels: use_fused_kernels=True with prefix_grouper.cross_micro_batch=true"]
