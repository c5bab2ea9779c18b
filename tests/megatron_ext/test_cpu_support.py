"""megatron-core 0.16.1 runs on CPU/gloo after enable_cpu_megatron(), and TP/PP match TP=1.

The stock local-spec GPTModel (SwiGLU, RMSNorm, RoPE, GQA) runs forward+backward over a few
``[b, s]`` micro-batches through ``get_forward_backward_func`` with megatron's own loss; TP=2
and PP=2 must give the TP=1 losses and gradients. Weights are seeded by parameter name
(``prefix_sharing.engines.megatron.seed_weights``), so every layout holds the same model.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

from prefix_sharing.megatron_ext import cpu_support
from prefix_sharing.megatron_ext.cpu_support import enable_cpu_megatron

from ._distributed import PRESET, run_distributed, tiny_gpt

MICRO_BATCHES, BATCH, SEQ = 4, 2, 16
RTOL = 1e-5


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids and next-token labels, [BATCH, SEQ] each, identical on every rank."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, PRESET.vocab_size, (MICRO_BATCHES, BATCH, SEQ + 1), generator=generator)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _train_step(rank: int) -> dict[str, Any]:
    """Forward+backward over all micro-batches, bshd input, attention_mask None (causal).

    The loss of a micro-batch is its mean token cross-entropy.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from prefix_sharing.engines.megatron import full_grads

    model = tiny_gpt("padded")
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        tokens, labels = next(data_iterator)
        output = model(tokens, position_ids, None, labels=labels)

        def loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            loss = per_token_loss.mean()
            # clone: the schedule divides `loss` by num_microbatches in place.
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(_micro_batches()),
        model=[model],
        num_microbatches=MICRO_BATCHES,
        seq_length=SEQ,
        micro_batch_size=BATCH,
    )
    last_stage = parallel_state.is_pipeline_last_stage()
    return {
        "losses": [d["loss"] for d in losses] if last_stage else None,
        "grads": full_grads(model),
    }


def _reference_step(rank: int) -> dict[str, Any]:
    """Enable twice more (the harness enabled once), then :func:`_train_step`.

    ``reenable_kept_patches``: the redirected objects are unchanged and the CUDA-to-CPU mode is
    on the stack once, i.e. nothing was wrapped or pushed twice.
    """
    def redirected() -> list[Any]:
        modes = torch.overrides._get_current_function_mode_stack()
        return [torch.cuda.current_device, torch.cuda.manual_seed, len(modes)]

    before = redirected()
    enable_cpu_megatron()
    enable_cpu_megatron()
    return {"reenable_kept_patches": redirected() == before, **_train_step(rank)}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The TP=1, PP=1 single-process run."""
    return run_distributed(_reference_step, 1)[0]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Max absolute difference over the largest expected magnitude is at most RTOL."""
    assert actual.shape == expected.shape, what
    rel = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert rel <= RTOL, f"{what}: max relative difference {rel:.2e}"


def _assert_matches_reference(
    reference: dict[str, Any], losses: list[torch.Tensor], grads: dict[str, torch.Tensor]
) -> None:
    _assert_close(torch.stack(losses), torch.stack(reference["losses"]), "losses")
    assert grads.keys() == reference["grads"].keys()
    for name, grad in grads.items():
        _assert_close(grad, reference["grads"][name], name)


def test_module_imports_without_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_support itself imports megatron only when enabling (loaded from its file, so that
    the package ``__init__`` is not part of the check)."""
    for name in [n for n in sys.modules if n.split(".")[0] == "megatron"]:
        monkeypatch.setitem(sys.modules, name, None)
    spec = importlib.util.spec_from_file_location("cpu_support_alone", cpu_support.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current_device = torch.cuda.current_device
    with pytest.raises(ImportError):
        module.enable_cpu_megatron()
    assert torch.cuda.current_device is current_device  # failed before patching anything


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_gdn_l2_norm_is_fla_s_kernel_in_torch(dtype: torch.dtype) -> None:
    """fla's Triton ``l2norm`` (``fla/modules/norm/l2norm.py``, 0.6.0): in float32,
    ``x * 1 / sqrt(sum(x * x) + eps)`` over the last dim, ``eps = 1e-6``, stored in x's dtype.
    The CPU stand-in computes that (float64 stays float64), tiny rows included, where eps
    matters."""
    x = torch.randn(3, 7, 4, 16, dtype=torch.float64)
    x[0, 0] *= 1e-4
    wide = x.to(dtype).to(torch.promote_types(dtype, torch.float32))
    expected = (wide * (1 / torch.sqrt((wide**2).sum(-1, keepdim=True) + 1e-6))).to(dtype)
    got = cpu_support._torch_l2norm(x.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected)  # the dtype's own rounding


def test_refuses_on_cuda_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        enable_cpu_megatron()


def test_cuda_stream_stays_a_class() -> None:
    """After enabling, ``torch.cuda.Stream`` is still a class: transformers >= 5.10 evaluates
    ``torch.cuda.Stream | None`` at import time, and the all-to-all dispatcher's stream calls
    are no-ops (fresh interpreter: the redirections cannot be undone)."""
    code = textwrap.dedent("""
        import torch
        from prefix_sharing.megatron_ext.cpu_support import enable_cpu_megatron
        enable_cpu_megatron()
        import transformers.modeling_utils  # noqa: F401
        stream = torch.cuda.Stream(device="cuda", priority=-1)
        assert isinstance(stream, torch.cuda.Stream)
        assert isinstance(torch.cuda.current_stream(), torch.cuda.Stream)
        assert (torch.cuda.Stream | None) is not None
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
        stream.record_event().synchronize()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_enable_is_idempotent(reference: dict[str, Any]) -> None:
    assert reference["reenable_kept_patches"]


def test_tp1_forward_backward_runs(reference: dict[str, Any]) -> None:
    losses = torch.stack(reference["losses"])
    # The sharp test model's predictions are peaked, and the targets random: worse than the
    # uniform guess's ln(vocab) per token, but finite and within a small multiple of it.
    uniform = torch.log(torch.tensor(float(PRESET.vocab_size)))
    assert bool(((losses > uniform) & (losses < 2 * uniform)).all()), losses
    assert all(grad.abs().sum() > 0 for grad in reference["grads"].values())


def test_tp2_matches_tp1(reference: dict[str, Any]) -> None:
    for result in run_distributed(_train_step, 2, tp=2):
        _assert_matches_reference(reference, result["losses"], result["grads"])


def test_pp2_matches_tp1(reference: dict[str, Any]) -> None:
    first_stage, last_stage = run_distributed(_train_step, 2, pp=2)
    grads = {**first_stage["grads"], **last_stage["grads"]}
    _assert_matches_reference(reference, last_stage["losses"], grads)


def _fail_on_rank_1(rank: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 breaks on purpose")
    torch.distributed.barrier()  # blocks: rank 1 never arrives; the parent must kill rank 0
    return rank


def test_child_exception_fails_parent_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed.*ValueError: rank 1 breaks"):
        run_distributed(_fail_on_rank_1, 2)
    assert not multiprocessing.active_children()


def _sleep_forever(rank: int) -> None:
    time.sleep(3600)


def test_hang_is_ended_by_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        run_distributed(_sleep_forever, 1, timeout=1)
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()


def test_a_gpu_user_s_imports_leave_the_cpu_support_out() -> None:
    """The layer specs, core attention, spec surgery and GDN mixer a GPU process imports do not
    import this module: only :func:`enable_cpu_megatron` registers its GDN redirections."""
    code = textwrap.dedent("""
        import importlib, sys
        import prefix_sharing.megatron_ext
        for name in ("spec_surgery", "stock_gdn", "core_attention", "layer_specs", "hybrid",
                     "gated_delta_net"):
            try:
                importlib.import_module(f"prefix_sharing.megatron_ext.{name}")
            except ImportError:  # the hybrid stack (0.18+) and the GDN mixer (0.19.2)
                pass
        print("prefix_sharing.megatron_ext.cpu_support" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
