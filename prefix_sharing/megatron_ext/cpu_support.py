"""Run megatron-core (0.16.1 - 0.19.2) on a CPU-only torch with gloo (tests, CI, laptops).

megatron-core hard-codes CUDA in the code paths that a forward/backward, a pipeline schedule and
an optimizer step go through. :func:`enable_cpu_megatron` redirects those to the CPU at runtime
(the installed package is never edited). Each redirection below names the megatron code that
needs it; each was checked to be needed by removing it and watching a GPTModel forward/backward
(TP=2, PP=2) or an optimizer step fail.

Nothing happens at import time, and megatron is imported only inside the functions, so this
module imports without megatron installed.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["enable_cpu_megatron", "enable_cpu_gated_delta_net"]

_enabled = False
_gdn_enabled = False


def enable_cpu_megatron() -> None:
    """Redirect megatron-core's hard-coded CUDA uses to the CPU, once per process.

    Safe to call any number of times, from any thread. Call it in every process that runs
    megatron (each spawned rank), before building models or calling
    ``model_parallel_cuda_manual_seed``, and again from every further thread that runs megatron
    (a Ray actor's methods may run on another thread than its constructor): the redirection of
    ``device="cuda"`` is a torch function mode, and those are per thread. The redirections are
    process-wide (``torch.cuda.manual_seed`` then seeds the CPU generator, for instance) and
    cannot be undone: call it only in processes meant to run megatron on CPU.

    Raises:
        RuntimeError: if ``torch.cuda.is_available()``: these redirections would silently move a
            CUDA machine's work to the CPU, so they must never run there.
        ImportError: if megatron-core is not installed.
    """
    global _enabled
    if torch.cuda.is_available():
        raise RuntimeError(
            "enable_cpu_megatron() is for CPU-only torch; CUDA is available here, so megatron-core "
            "must run on the GPU unpatched."
        )
    if _enabled:
        _redirect_megatron_cuda_tensors()
        return
    # Imported before anything is patched, so that without megatron nothing changes.
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer import attention, torch_norm
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher

    _redirect_current_device()
    _redirect_cuda_rng(megatron_random)
    _redirect_cuda_synchronize()
    _redirect_cuda_streams()
    _define_missing_te_gemm(moe_utils)
    _host_split_sizes(token_dispatcher)
    _redirect_default_causal_mask(fused_softmax)
    _redirect_megatron_cuda_tensors()
    _allow_sequence_parallel_torch_norm(torch_norm)
    _mla_without_te()
    _eager_jit_fusions(attention.Attention)
    _eager_jit_fusions(router.TopKRouter)
    _enabled = True
    from .stock_gdn import before_building_gdn

    before_building_gdn(enable_cpu_gated_delta_net)
    if "megatron.core.ssm.gated_delta_net" in sys.modules:
        enable_cpu_gated_delta_net()


def enable_cpu_gated_delta_net() -> None:
    """The CPU redirections of megatron's Gated DeltaNet module, once per process; nothing
    unless :func:`enable_cpu_megatron` ran (then it is a CPU-only process).

    Separate from :func:`enable_cpu_megatron` because importing the GDN module imports
    flash-linear-attention (about a second), which only hybrid models need: the code that
    builds a GDN layer (:func:`~.stock_gdn.gdn_layer_spec`, :mod:`.gated_delta_net`) calls it
    through :func:`~.stock_gdn.prepare_gated_delta_net`, where :func:`enable_cpu_megatron`
    registers it (so a GPU process never imports this module).
    """
    global _gdn_enabled
    if not _enabled or _gdn_enabled:
        return
    _torch_gated_delta_net_l2norm()
    _torch_gated_delta_net_kernels()
    try:
        from megatron.core.ssm.gated_delta_net.common import _GDNBase
    except ImportError:  # before 0.19 (its GDN is compiled as it is), or no fla
        pass
    else:
        _eager_jit_fusions(_GDNBase)
    _gdn_enabled = True


def _redirect_current_device() -> None:
    # tensor_parallel/layers.py + mappings.py, rotary_pos_embedding.py, p2p_communication.py and
    # more allocate with `device=torch.cuda.current_device()`, which raises without CUDA.
    torch.cuda.current_device = lambda: torch.device("cpu")


def _redirect_cuda_rng(megatron_random: ModuleType) -> None:
    # tensor_parallel/random.py CudaRNGStatesTracker.fork(), entered by every
    # DotProductAttention.forward and by weight init, swaps generator states through these two
    # helpers; on CPU, random ops draw from the CPU generator, so that is the one to swap.
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # fork() warns "CPU RNG state changed within GPU RNG context" when random ops ran inside it:
    # with the CPU generator standing in for the CUDA one, that is what forking is for.
    logging.getLogger(megatron_random.__name__).addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage()
    )
    # CudaRNGStatesTracker.add() and model_parallel_cuda_manual_seed() seed through torch.cuda:
    # get_rng_state raises on CPU, and manual_seed is silently dropped (every tracker state
    # would be the same and ignore the seed).
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed


def _redirect_cuda_synchronize() -> None:
    # pipeline_parallel/p2p_communication.py calls torch.cuda.synchronize() after batched
    # send/recv; CPU collectives are complete once their wait() returns.
    torch.cuda.synchronize = lambda device=None: None


class _HostStream:
    """The CPU's one stream: waiting on it or synchronizing it is a no-op.

    It replaces the class ``torch.cuda.Stream`` and must stay a class: other libraries use
    ``torch.cuda.Stream`` as a type (transformers >= 5.10 writes ``torch.cuda.Stream | None`` in
    annotations evaluated at import time, and ``isinstance`` checks are common).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # device, priority: one host stream
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostStream:  # as complete as the stream
        return self


def _redirect_cuda_streams() -> None:
    # transformer/moe/token_dispatcher.py's all-to-all dispatcher creates a torch.cuda.Stream
    # and moves its split sizes to the host on it (current_stream, wait_stream, cuda.stream,
    # record_event().synchronize()).
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda device=None: _HostStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()


def _define_missing_te_gemm(moe_utils: ModuleType) -> None:
    # transformer/moe/moe_utils.py's router_gating_linear tests `te_general_gemm is not None`,
    # a name only its Transformer Engine import defines: without TE the router's gate raises
    # NameError instead of taking its torch.mm path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _host_split_sizes(token_dispatcher: ModuleType) -> None:
    # transformer/moe/token_dispatcher.py turns its all-to-all split sizes into host lists with
    # maybe_move_tensor_to_cpu(as_numpy=True), which converts only CUDA tensors; gloo's
    # all_to_all_single refuses the CPU tensors it returns as they are.
    move = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _redirect_default_causal_mask(fused_softmax: ModuleType) -> None:
    # fusions/fused_softmax.py builds the causal mask with transformer/utils.py's
    # get_default_causal_mask (device="cuda") when attention_mask is None. The mode below covers
    # the forward, but not a recomputation inside backward (activation checkpointing), where
    # torch function modes are not active.
    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq).triu_(1).bool()


def _allow_sequence_parallel_torch_norm(torch_norm: ModuleType) -> None:
    # transformer/torch_norm.py: WrappedTorchNorm, the local spec's norm without apex (always on
    # CPU), asserts `not config.sequence_parallel`; megatron's sequence-parallel norms are TE's
    # and apex's, both CUDA-only. A per-token norm computes the same on a sequence shard; what
    # those norms add is the `sequence_parallel` mark on their parameters, by which
    # finalize_model_grads all-reduces their gradients over the tensor-parallel group (each
    # rank saw only its shard of the tokens). So: build the norm as without sequence
    # parallelism, then mark its parameters.
    build = torch_norm.WrappedTorchNorm.__new__

    def build_sequence_parallel(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return build(cls, config, *args, **kwargs)
        unsplit = copy.copy(config)  # no __post_init__: only the flag differs
        unsplit.sequence_parallel = False
        norm = build(cls, unsplit, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(build_sequence_parallel)


def _mla_without_te() -> None:
    # transformer/multi_latent_attention.py (0.16.1 - 0.17.1) sets HAVE_TE when
    # extensions/transformer_engine imports - which it does without Transformer Engine, with
    # MagicMock stand-ins for the TE classes - and MultiLatentAttention.__init__ then raises in
    # `isinstance(self.linear_proj, TELinear)`. Without TE that branch is the non-TE one.
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def _torch_gated_delta_net_l2norm() -> None:
    # ssm/gated_delta_net/common.py (megatron-core 0.19; gated_delta_net.py before) L2-normalises
    # the GDN queries and keys with flash-linear-attention's `l2norm`, a Triton kernel that has
    # no CPU driver. The same function in torch: x / sqrt(sum(x^2) + eps) over the last dim,
    # computed in float32 or wider and returned in x's dtype (or output_dtype), fla's defaults.
    for name in ("megatron.core.ssm.gated_delta_net.common", "megatron.core.ssm.gated_delta_net"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # no GDN in this release, or flash-linear-attention missing
            continue
        if getattr(module, "l2norm", None) is not None:
            module.l2norm = _torch_l2norm
            return


def _torch_gated_delta_net_kernels() -> None:
    # ssm/gated_delta_net/gdn.py (megatron-core 0.19) runs a packed (THD) batch through fla's
    # Triton `causal_conv1d` and `chunk_gated_delta_rule` (bound at construction as
    # `self.gated_delta_rule`); its torch path (deterministic_mode) refuses packed input. The
    # same calls on this package's torch kernels (prefix_sharing.recurrent.batch_major), so the
    # stock module's THD step - bench's plain baseline - runs unchanged apart from its kernels.
    try:
        gdn = importlib.import_module("megatron.core.ssm.gated_delta_net.gdn")
    except ImportError:  # before 0.19 (no packed GDN path), or flash-linear-attention missing
        return
    from ..recurrent.batch_major import causal_conv1d_batch_major, gated_delta_rule_batch_major

    gdn.causal_conv1d = causal_conv1d_batch_major
    gdn.chunk_gated_delta_rule = gated_delta_rule_batch_major


def _eager_jit_fusions(cls: type) -> None:
    # Methods decorated with megatron's `jit_fuser`, which is `torch.compile` - the attention's
    # `_apply_output_gate`, the GDN module's `_prepare_input_for_gated_delta_rule`,
    # `_compute_g_and_beta` and `_apply_gated_norm` (megatron-core 0.19), the MoE router's
    # `_apply_expert_bias` (a stock router's expert-bias count) - make inductor compile
    # C++ on a CPU for every new shape and dtype (10-30 s each, minutes for a few
    # micro-batches), for elementwise fusions a GPU benefits from. Their undecorated functions
    # compute the same; the class gets those back.
    for name, value in list(vars(cls).items()):
        original = getattr(value, "_torchdynamo_orig_callable", None)
        if original is not None:
            setattr(cls, name, original)


def _torch_l2norm(x: torch.Tensor, eps: float = 1e-6,
                  output_dtype: torch.dtype | None = None) -> torch.Tensor:
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    y = wide * (1 / torch.sqrt((wide * wide).sum(-1, keepdim=True) + eps))
    return y.to(x.dtype if output_dtype is None else output_dtype)


def _redirect_megatron_cuda_tensors() -> None:
    # device="cuda" tensors: pipeline_parallel/schedules.py (every forward_backward_* starts with
    # `torch.zeros(..., device="cuda")`), transformer/utils.get_default_causal_mask (when
    # attention_mask is None), optimizer/optimizer.py buffers, optimizer/clip_grads.py buffers;
    # and clip_grads.py asserts `param.grad.type() == 'torch.cuda.FloatTensor'`. Once per thread.
    if not getattr(_THREAD, "redirected", False):
        _MegatronCudaOnCpu().__enter__()
        _THREAD.redirected = True


_THREAD = threading.local()


class _MegatronCudaOnCpu(TorchFunctionMode):
    """For torch calls made directly from megatron's code: device "cuda" is the CPU,
    ``Tensor.cuda()`` keeps a tensor where it is, and ``Tensor.type()`` names CPU tensors as
    CUDA ones.

    Pushed once and never popped, so that every megatron entry point (schedules, DDP buffers,
    optimizer, clip_grads, ...) is covered without the caller scoping each one. It is limited to
    calls whose caller is a ``megatron.*`` module: this project's own code (which also runs on
    Ascend NPUs, where "cuda" is wrong) and other libraries keep failing loudly on a hard-coded
    "cuda" and never see the ``Tensor.type()`` pretence. Its cost is one Python call per torch
    call in this thread (within run-to-run noise on the tiny test models).
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        device_is_cuda = str(kwargs.get("device")).startswith("cuda")
        asks_type_name = func is torch.Tensor.type and len(args) == 1 and not kwargs
        asks_type_name = asks_type_name and args[0].device.type == "cpu"
        moves_to_cuda = func is torch.Tensor.cuda  # a tied embedding copy across stages
        if not (device_is_cuda or asks_type_name or moves_to_cuda) or not _called_from_megatron():
            return func(*args, **kwargs)
        if moves_to_cuda:
            return args[0]
        if device_is_cuda:
            return func(*args, **{**kwargs, "device": "cpu"})
        return func(*args).replace("torch.", "torch.cuda.", 1)


def _called_from_megatron() -> bool:
    """Whether the torch call being intercepted was made by a ``megatron.*`` module.

    Frame 1 is ``__torch_function__``; the factory functions and ``Tensor.type`` are C code
    without a Python frame, so frame 2 is the code that called them.
    """
    return sys._getframe(2).f_globals.get("__name__", "").startswith("megatron.")
