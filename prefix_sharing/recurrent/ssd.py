"""The Mamba-2 (SSD) scan behind one interface, and its runs over a recurrence schedule.

:func:`chunk_ssd` is the scan over varlen sequences, each from its own initial state,
optionally returning each one's final state (shapes as flash-attn's varlen API: token-major
tensors in, tensors out). Backends: ``"torch"`` (:mod:`.ssd_torch`, any device, the reference)
and ``"mamba_ssm"`` (:mod:`.mamba_kernels`, mamba_ssm's Triton kernel, CUDA; one piece per
batch row, see there why not varlen); ``"auto"`` takes mamba_ssm on CUDA when it is installed,
else torch.

Over a plan, a Mamba-2 mixer calls :func:`ssd_over_schedule` with the micro-batch's
:class:`~prefix_sharing.recurrent.schedule.RecurrenceSchedule`: one kernel call per depth
bucket, each piece started from its parent's final state (gathered differentiably, so a
reuser's gradient flows into its provider's rows through the state). Its short convolution is
:func:`~prefix_sharing.recurrent.gated_delta.causal_conv1d_over_schedule`, the same gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError
from ..kernel_backends import KernelBackends, Package
from . import mamba_kernels, ssd_torch
from .schedule import RecurrenceSchedule

__all__ = ["SSD_BACKENDS", "resolve_ssd_backend", "chunk_ssd", "ssd_over_schedule"]

_BACKENDS = KernelBackends(
    kind="SSD-kernel backend",
    packages={"torch": None,
              "mamba_ssm": Package("mamba_ssm", "mamba-ssm", "pip install mamba-ssm")},
    auto={"cuda": ("mamba_ssm",)},
)
SSD_BACKENDS = tuple(_BACKENDS.packages)


def resolve_ssd_backend(name: str, device: torch.device) -> str:
    """``"torch"`` or ``"mamba_ssm"`` for ``name`` (``"auto"``: mamba_ssm on CUDA when
    installed).

    Raises:
        InputError: an unknown name; MissingPackageError: ``"mamba_ssm"`` not installed.
    """
    resolved = _BACKENDS.resolve(name, device)
    _BACKENDS.require(resolved)
    return resolved


def chunk_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens_host: Sequence[int] | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The SSD scan over varlen sequences (see :mod:`.ssd_torch` for the recurrence).

    Args:
        x: ``(total, H, P)``.
        dt: ``(total, H)`` discretized step sizes (:func:`~.ssd_torch.discretize_dt`).
        A: ``(H,)`` negative decay rates.
        B, C: ``(total, G, N)``, head ``h`` reading group ``h // (H // G)``.
        D: ``(H,)`` skip weights or ``None``.
        initial_state: ``(num_seqs, H, P, N)``; zeros when ``None``.
        output_final_state: also return each sequence's final state.
        cu_seqlens_host: the sequences' boundaries as host ints; one sequence when ``None``.
        backend: ``"auto"``, ``"torch"`` or ``"mamba_ssm"``.

    Returns:
        ``(y, final_state)``: ``y`` ``(total, H, P)`` in x's dtype; ``final_state``
        ``(num_seqs, H, P, N)`` (float32; float64 for float64 inputs on torch) or ``None``.
        Differentiable in every input, ``initial_state`` included.
    """
    bounds = (0, x.size(0)) if cu_seqlens_host is None else tuple(cu_seqlens_host)
    kwargs = dict(D=D, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens_host=bounds)
    if resolve_ssd_backend(backend, x.device) == "mamba_ssm":
        return mamba_kernels.chunk_ssd_mamba(x, dt, A, B, C, **kwargs)
    return ssd_torch.chunk_ssd_torch(x, dt, A, B, C, **kwargs)


def ssd_over_schedule(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    schedule: RecurrenceSchedule,
    *,
    D: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The SSD scan of the plan's flat rows, every piece from its parent's state.

    Inputs are flat-layout rows (``total = T_flat``), shaped as in :func:`chunk_ssd`. Bucket by
    bucket (depth 0 first), the bucket's rows are gathered, its pieces start from their
    parents' final states (``finals.index_select(0, parent_index)``, differentiable) and run in
    one call.

    Returns:
        ``(T_flat, H, P)`` in x's dtype, in flat-row order.
    """
    if x.size(0) != schedule.num_rows:
        raise InputError(f"the recurrence schedule covers {schedule.num_rows} flat rows; "
                         f"got {x.size(0)}")
    name = resolve_ssd_backend(backend, x.device)
    last = len(schedule.buckets) - 1
    outs, finals = [], None
    for depth, bucket in enumerate(schedule.buckets):
        inputs = (x, dt, B, C)
        if last:  # several buckets: each reads its own rows
            inputs = tuple(t.index_select(0, bucket.rows) for t in inputs)
        initial = None if bucket.parent_index is None else finals.index_select(
            0, bucket.parent_index)
        xb, dtb, Bb, Cb = inputs
        out, finals = chunk_ssd(xb, dtb, A, Bb, Cb, D=D, initial_state=initial,
                                output_final_state=depth < last,
                                cu_seqlens_host=bucket.cu_seqlens_host, backend=name)
        outs.append(out)
    out = torch.cat(outs) if last else outs[0]
    return out if schedule.inverse_order is None else out.index_select(0, schedule.inverse_order)
