"""verl 0.9.1's real Megatron engine on megatron-core 0.19.2 runs a Gated DeltaNet hybrid with
``prefix_grouper: {mode: arbitrary_prefix}`` and its step equals verl's stock step on the same
weights: old log-probs, entropy, ``ppo_loss`` and every gradient, float64 within 1e-5, on a tree
batch (a branch inside a provider's tail, a duplicate, a strict prefix). One process.

The model is the ``tiny-hybrid`` preset's ``HybridModel`` (``G-G-G-*-``: three GDN layers, one
gated attention layer with partial rotary and QK-norm), injected into the engine as
``tests/verl_ext/_engine.py`` injects its GPT: verl builds Megatron models only through a bridge,
and neither builds one on CPU (the vanilla mbridge has no Qwen3.5 / Qwen3-Next; Megatron-Bridge
imports Transformer Engine). Both runs use the sharing stack spec; without a plan (sharing off)
its layers are megatron's stock ones on verl's packed row. Megatron's stock GDN runs packed rows
only through fla's Triton kernels, so on CPU its convolution and gated delta rule are redirected
to torch varlen kernels (:func:`stock_gdn_on_cpu`); the sharing run does not call them.

Needs verl 0.9.1 beside megatron-core 0.19.2 (Python 3.12): ``.ci/verl_overlay.sh .venv-py312``,
then ``PYTHONPATH=.venv-py312/verl-0.9.1 .venv-py312/bin/python -m pytest -q <this file>``;
elsewhere the module skips.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

from tests.verl_ext._requires import require_verl

require_verl("0.9.1")

from importlib.metadata import version  # noqa: E402

if version("megatron-core") != "0.19.2":  # the release whose GDN sharing serves (cheap check)
    pytest.skip("needs megatron-core 0.19.2's Gated DeltaNet (.ci/verl_overlay.sh on the "
                "Python 3.12 environment)", allow_module_level=True)

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402

SHARING = {"off": None, "arbitrary_prefix": MODES["arbitrary_prefix"]}


def stock_gdn_on_cpu(model) -> None:
    """Megatron's stock GDN on packed rows without fla: its ``causal_conv1d`` (a module name of
    ``megatron.core.ssm.gated_delta_net.gdn``) and each layer's ``gated_delta_rule`` become torch
    varlen kernels (the convolution per segment, the project's torch chunked rule)."""
    import megatron.core.ssm.gated_delta_net.gdn as gdn
    import torch
    import torch.nn.functional as F

    from prefix_sharing.recurrent import chunk_gated_delta_rule

    def causal_conv1d(x, weight, bias, activation, initial_state=None, output_final_state=False,
                      cu_seqlens=None):
        assert initial_state is None and not output_final_state and activation in ("silu",
                                                                                    "swish")
        bounds = cu_seqlens.tolist()  # a test reference: one host copy per layer is fine
        width, channels = weight.size(1), weight.size(0)
        segments = [F.silu(F.conv1d(F.pad(x[:, s:e].transpose(1, 2), (width - 1, 0)),
                                    weight.unsqueeze(1), bias, groups=channels))
                    for s, e in zip(bounds[:-1], bounds[1:])]  # [1, D, len] each
        return torch.cat(segments, -1).transpose(1, 2), None  # [1, T, D]

    def gated_delta_rule(q, k, v, *, g, beta, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        assert initial_state is None and not output_final_state
        out, _ = chunk_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], cu_seqlens=cu_seqlens,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                        backend="torch")  # [1, T, ...] -> [T, ...]
        return out.unsqueeze(0), None

    gdn.causal_conv1d = causal_conv1d
    for module in model.modules():
        if hasattr(module, "gated_delta_rule"):
            module.gated_delta_rule = gated_delta_rule


def run(rank: int) -> dict:
    """The tree batch with sharing off and on, each on a fresh float64 copy of the same seeded
    ``tiny-hybrid`` model: ``infer_batch``, then ``forward_backward_batch`` with ``ppo_loss``."""
    import torch
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401  (registers the engine)
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.engines.megatron import hybrid_model
    from prefix_sharing.presets import PRESETS
    from prefix_sharing.verl_ext.engine import registered_engine
    from tests.verl_ext._batch import make_batch, plain_output, use_cpu_platform
    from tests.verl_ext._engine import actor_config

    use_cpu_platform()
    engine_cls = registered_engine("language_model", "megatron")
    model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["Qwen3NextForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        mtp=SimpleNamespace(enable=False, enable_train=False), model_type="language_model")
    results = {}
    for name, prefix_grouper in SHARING.items():
        config = actor_config(prefix_grouper)
        engine = engine_cls(model_config, config.engine, config.optim, config.checkpoint)
        model = hybrid_model(PRESETS["tiny-hybrid"], dtype=torch.float64)
        stock_gdn_on_cpu(model)
        engine.module, engine.tf_config, engine.is_value_model = [model], model.config, False
        infer = engine.infer_batch(make_batch("tree"))
        train = engine.forward_backward_batch(make_batch("tree"), partial(ppo_loss, config=config))
        results[name] = {"infer": plain_output(infer), "train": plain_output(train),
                         "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                         "engine": type(engine).__name__}
    return results


@pytest.fixture(scope="module")
def runs():
    return run_distributed(run, 1, timeout=600)[0]


def test_shared_step_equals_verls_stock_step_in_float64(runs):
    on, off = runs["arbitrary_prefix"], runs["off"]
    assert on["engine"] == "PrefixSharingMegatronEngine"
    assert any(".A_log" in name for name in off["grads"]), "no Gated DeltaNet layer compared"
    same_outputs(on, off, "tiny-hybrid tree float64")


def test_the_step_shared_tokens(runs):
    metrics = runs["arbitrary_prefix"]["train"]["metrics"]
    assert metrics["prefix_sharing/tokens_computed"][0] < metrics["prefix_sharing/tokens_total"][0]
    assert not any(key.startswith("prefix_sharing/") for key in runs["off"]["train"]["metrics"])
