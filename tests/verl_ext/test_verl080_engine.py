"""verl 0.8.0's real Megatron engine with ``prefix_grouper`` on gives what it gives with it off.

The same engine drive as the 0.9.1 tests (``_engine.run``: old log-probs and entropy from
``infer_batch``, verl's ``ppo_loss`` and every gradient from ``forward_backward_batch``), on GRPO,
step-wise, tree and agent batches, one process and tensor-parallel 2 (gloo). Then what is
particular to 0.8.0: the layer spec reaches the model through the real vanilla mbridge
(``_build_tf_config`` -> ``bridge.get_model``), per engine instance. (The group-keeping split in
the engine: test_microbatch_engine.py, for both verl releases.)
"""

import pytest

from tests.verl_ext._requires import require_verl

require_verl("0.8.0")

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from prefix_sharing.verl_ext import installed  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402
from tests.verl_ext._batch import WORKLOADS, use_cpu_platform  # noqa: E402
from tests.verl_ext._engine import actor_config, run  # noqa: E402


def run_080(rank: int, tp: int) -> dict:
    """One rank: the equivalence runs, then (one process only) the layer-spec run."""
    workloads = list(WORKLOADS) if tp == 1 else ["grpo", "tree"]
    modes = MODES if tp == 1 else {k: MODES[k] for k in ("off", "arbitrary_prefix")}
    results = {"equivalence": run(rank, workloads, modes)}
    if tp == 1:
        results["spec"] = _mbridge_layer_spec()
    return results


def _mbridge_layer_spec() -> dict:
    """Two engines in one process, as the actor (sharing) and the reference model (off):
    verl's own ``_build_tf_config`` makes the vanilla mbridge, whose ``get_model`` builds the
    GPTModel. mbridge asks for the Transformer-Engine spec, which needs CUDA: the stand-in is
    megatron's local spec (same structure), set on mbridge's class before either engine exists."""
    from types import SimpleNamespace

    import torch
    from mbridge.core.llm_bridge import LLMBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from transformers import Qwen2Config

    from prefix_sharing.verl_ext.engine import registered_engine

    LLMBridge._get_transformer_layer_spec = lambda self, vp_stage=None: get_gpt_decoder_block_spec(
        self.config, use_transformer_engine=False)
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self  # mbridge moves the model to CUDA
    hf_config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=False)
    model_config = SimpleNamespace(hf_config=hf_config, tokenizer=SimpleNamespace(pad_token_id=0),
                                   mtp=SimpleNamespace(enable=False, enable_train=False))
    engine_cls = registered_engine("language_model", "megatron")
    found = {}
    for name, mode in (("actor", "arbitrary_prefix"), ("ref", "off")):
        config = actor_config(MODES[mode])
        engine = engine_cls(model_config, config.engine, config.optim, config.checkpoint)
        engine._build_tf_config()
        model = engine.bridge.get_model(wrap_with_ddp=False, bf16=False,
                                        post_model_creation_callbacks=[])
        found[name] = {type(layer.self_attention.core_attention).__name__
                       for layer in model[0].decoder.layers}
    found["engine"] = engine_cls.__name__
    return found


_RUNS: dict[int, list] = {}


def _ranks(tp: int) -> list:
    if tp not in _RUNS:
        _RUNS[tp] = run_distributed(run_080, tp, tp, tp=tp, timeout=500)
    return _RUNS[tp]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def results(request):
    return request.param, _ranks(request.param)


@pytest.fixture(scope="module")
def one_process():
    return _ranks(1)[0]


def test_the_verl080_patch_sets_are_the_ones_applied():
    use_cpu_platform()
    names = installed()
    assert "verl080_mcore" in names and all(n.startswith("verl080_") for n in names), names


def test_log_probs_entropy_loss_and_gradients_match_the_feature_off(results):
    tp, per_rank = results
    for rank_result in per_rank:
        runs = rank_result["equivalence"]
        for (workload, mode), shared in runs.items():
            if mode != "off":
                same_outputs(shared, runs[workload, "off"], f"tp{tp} {workload} {mode}")


def test_sharing_metrics_reach_verls_metrics_dict(results):
    tp, per_rank = results
    for (workload, mode), run_ in per_rank[0]["equivalence"].items():
        metrics = run_["train"]["metrics"]
        if mode == "off":
            assert not any(k.startswith("prefix_sharing/") for k in metrics)
        else:
            [computed], [total] = (metrics[f"prefix_sharing/tokens_{k}"] for k in ("computed", "total"))
            assert computed < total, f"{workload} {mode}: nothing shared"
            # verl's worker all-gathers each metric over DP ranks, then flattens a list (or
            # aggregates its own Metric objects): a bare number fails there
            assert all(isinstance(value, list) for key, value in metrics.items()
                       if key.startswith("prefix_sharing/")), metrics


def test_the_layer_spec_reaches_the_model_through_mbridge_for_the_sharing_engine_only(one_process):
    spec = one_process["spec"]
    assert spec == {"actor": {"PrefixSharingCoreAttention"}, "ref": {"DotProductAttention"},
                    "engine": "PrefixSharingMegatronEngine"}
