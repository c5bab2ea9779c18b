"""Gated DeltaNet kernels behind one interface, and their runs over a recurrence schedule.

Two kernel calls, shaped like flash-attn's varlen API (token-major tensors in, tensors out):

- :func:`chunk_gated_delta_rule`: the gated delta rule over varlen sequences, each from its own
  initial state, optionally returning each one's final state (fla's
  ``chunk_gated_delta_rule(..., initial_state, output_final_state, cu_seqlens)``).
- :func:`causal_conv1d`: the short depthwise causal convolution over the plan's segments.

Backends: ``"torch"`` (:mod:`.torch_kernels`, any device, the reference) and ``"fla"``
(:mod:`.fla_kernels`, flash-linear-attention's Triton kernels, CUDA); ``"auto"`` takes fla on
CUDA when it is installed, else torch.

Over a plan, a recurrent layer calls :func:`gated_delta_rule_over_schedule` and
:func:`causal_conv1d_over_schedule` with the micro-batch's
:class:`~prefix_sharing.recurrent.schedule.RecurrenceSchedule`: with fla one kernel call per
depth bucket, each piece started from its parent's final state (gathered differentiably, so a
reuser's gradient flows into its provider's rows through the state); with torch one pass over
the whole forest of pieces (:mod:`.forest`); and one convolution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError
from ..kernel_backends import KernelBackends, Package
from ..memo import derived
from . import fla_kernels, torch_kernels
from .forest import ForestLayout, gated_delta_rule_forest
from .schedule import RecurrenceSchedule

__all__ = ["RECURRENT_BACKENDS", "resolve_recurrent_backend", "chunk_gated_delta_rule",
           "gated_delta_rule_over_schedule", "causal_conv1d", "causal_conv1d_over_schedule"]

_BACKENDS = KernelBackends(
    kind="recurrent-kernel backend",
    packages={"torch": None,
              "fla": Package("fla", "flash-linear-attention", "pip install fla-core")},
    auto={"cuda": ("fla",)},
)
RECURRENT_BACKENDS = tuple(_BACKENDS.packages)


def resolve_recurrent_backend(name: str, device: torch.device) -> str:
    """``"torch"`` or ``"fla"`` for ``name`` (``"auto"``: fla on CUDA when installed).

    Raises:
        InputError: an unknown name; MissingPackageError: ``"fla"`` without ``fla-core``.
    """
    resolved = _BACKENDS.resolve(name, device)
    _BACKENDS.require(resolved)
    return resolved


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_host: Sequence[int] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over varlen sequences (see :mod:`.torch_kernels` for the rule).

    Args:
        q, k: ``(total, H, K)`` queries and keys.
        v: ``(total, HV, V)`` values; ``HV`` a multiple of ``H`` (value head ``h`` reads q/k
            head ``h // (HV // H)``: grouped value heads).
        g: ``(total, HV)`` log decays, ``<= 0`` (the state is multiplied by ``exp(g)``).
        beta: ``(total, HV)`` write strengths, usually in ``(0, 1)``.
        scale: multiplies q; ``K ** -0.5`` when ``None``.
        initial_state: ``(N, HV, K, V)`` one state per sequence; zeros when ``None``.
        output_final_state: also return each sequence's final state.
        cu_seqlens: ``(N + 1,)`` int32/int64 boundaries on q's device; one sequence when
            ``None``.
        cu_seqlens_host: the same boundaries as host ints (spares the kernels a device copy).
        use_qk_l2norm_in_kernel: L2-normalise q and k first (Qwen3.5 / Qwen3-Next do).
        backend: ``"auto"``, ``"torch"`` or ``"fla"``.

    Returns:
        ``(o, final_state)``: ``o`` ``(total, HV, V)`` in v's dtype; ``final_state``
        ``(N, HV, K, V)`` float32 (float64 for float64 inputs on torch) or ``None``.
        Differentiable in every input, ``initial_state`` included.
    """
    if cu_seqlens is None:
        cu_seqlens_host = (0, q.size(0))
        cu_seqlens = torch.tensor(cu_seqlens_host, dtype=torch.int32, device=q.device)
    elif cu_seqlens_host is None:
        cu_seqlens_host = tuple(cu_seqlens.tolist())  # a device copy: callers pass host ints
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens_host=cu_seqlens_host,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if resolve_recurrent_backend(backend, q.device) == "fla":
        return fla_kernels.chunk_gated_delta_rule_fla(q, k, v, g, beta, cu_seqlens=cu_seqlens,
                                                      **kwargs)
    return torch_kernels.chunk_gated_delta_rule_torch(q, k, v, g, beta, **kwargs)


def gated_delta_rule_over_schedule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    schedule: RecurrenceSchedule,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """The gated delta rule of the plan's flat rows, every piece from its parent's state.

    Inputs are flat-layout rows (``total = T_flat``), shaped as in
    :func:`chunk_gated_delta_rule`. fla: bucket by bucket (depth 0 first), the bucket's rows
    are gathered, its pieces start from their parents' final states
    (``finals.index_select(0, parent_index)``, differentiable) and run in one varlen call.
    torch: :func:`~.forest.gated_delta_rule_forest`, the same rule in one pass.

    Returns:
        ``(T_flat, HV, V)`` in v's dtype, in flat-row order.
    """
    if q.size(0) != schedule.num_rows:
        raise InputError(f"the recurrence schedule covers {schedule.num_rows} flat rows; "
                         f"got {q.size(0)}")
    name = resolve_recurrent_backend(backend, q.device)
    if name == "torch":  # one intra-chunk pass and one scan over the whole forest
        return gated_delta_rule_forest(q, k, v, g, beta, forest_layout(schedule, q.device),
                                       scale=scale,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    last = len(schedule.buckets) - 1
    outs, finals = [], None
    for depth, bucket in enumerate(schedule.buckets):
        inputs = (q, k, v, g, beta)
        if last:  # several buckets: each reads its own rows
            inputs = tuple(x.index_select(0, bucket.rows) for x in inputs)
        initial = None if bucket.parent_index is None else finals.index_select(
            0, bucket.parent_index)
        out, finals = chunk_gated_delta_rule(
            *inputs, scale=scale, initial_state=initial, output_final_state=depth < last,
            cu_seqlens=bucket.cu_seqlens, cu_seqlens_host=bucket.cu_seqlens_host,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, backend=name)
        outs.append(out)
    out = torch.cat(outs) if last else outs[0]
    return out if schedule.inverse_order is None else out.index_select(0, schedule.inverse_order)


def forest_layout(schedule: RecurrenceSchedule, device: torch.device,
                  chunk_size: int = torch_kernels.CHUNK_SIZE) -> ForestLayout:
    """The torch backend's chunk layout of ``schedule``, built on first use (per device and
    chunk size) and then read by every layer of the micro-batch (:mod:`prefix_sharing.memo`)."""
    return derived(schedule, _build_forest_layout, device, chunk_size)


def _build_forest_layout(schedule: RecurrenceSchedule, device: torch.device,
                         chunk_size: int) -> ForestLayout:
    return ForestLayout(schedule.pieces, schedule.num_rows, chunk_size, device)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    predecessors: torch.Tensor,
    *,
    activation: str | None = None,
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: Sequence[int],
    backend: str = "auto",
) -> torch.Tensor:
    """The depthwise causal convolution of the flat rows, each reading its path's inputs.

    Args:
        x: ``(T_flat, D)`` the convolution's inputs.
        weight: ``(D, W)``; ``bias`` ``(D,)`` or ``None``.
        predecessors: ``(T_flat, W - 1)`` int64, each row's ``W - 1`` predecessors on its
            path, oldest first, ``-1`` before the sequence starts
            (:meth:`~prefix_sharing.recurrent.schedule.RecurrenceSchedule.conv_predecessors`).
        activation: ``None``, ``"silu"`` or ``"swish"``.
        cu_seqlens, cu_seqlens_host: the plan's query segments: fla runs one varlen call over
            them, each segment's initial state the inputs at its first row's predecessors;
            torch gathers every row's window directly.
        backend: ``"auto"``, ``"torch"`` or ``"fla"``.

    Returns:
        ``(T_flat, D)`` in x's dtype, differentiable (through the gathers into the rows read).
    """
    if resolve_recurrent_backend(backend, x.device) == "fla":
        starts = torch.tensor(tuple(cu_seqlens_host[:-1]), dtype=torch.long, device=x.device)
        first = predecessors.index_select(0, starts)  # [M, W-1]
        padded = torch.cat([x.new_zeros(1, x.size(1)), x])
        initial = padded.index_select(0, first.flatten() + 1).view(*first.shape, x.size(1))
        return fla_kernels.causal_conv1d_fla(x, weight, bias, initial, activation=activation,
                                             cu_seqlens=cu_seqlens,
                                             cu_seqlens_host=cu_seqlens_host)
    return torch_kernels.causal_conv1d_torch(x, weight, bias, predecessors, activation)


def causal_conv1d_over_schedule(x: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None, schedule: RecurrenceSchedule, *,
                                activation: str | None = None,
                                backend: str = "auto") -> torch.Tensor:
    """:func:`causal_conv1d` of the plan's flat rows (``x`` ``(T_flat, D)``, weight
    ``(D, W)``), the predecessors and segments read from ``schedule``."""
    return causal_conv1d(x, weight, bias, schedule.conv_predecessors(weight.size(1)),
                         activation=activation, cu_seqlens=schedule.cu_seqlens,
                         cu_seqlens_host=schedule.cu_seqlens_host, backend=backend)
