"""mamba_ssm's Triton SSD kernel (``mamba-ssm``, CUDA): argument construction and the call.

``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=,
z=, dt_bias=, initial_states=, seq_idx=, cu_seqlens=, dt_softplus=, dt_limit=,
return_final_states=, return_varlen_states=)`` takes batch-major ``(batch, seqlen, ...)`` inputs
and **one initial state per batch row** (``(batch, nheads, headdim, dstate)``). What it refuses
for a schedule's needs (state-spaces/mamba, ``ssd_combined.py``):

- ``seq_idx`` packs several sequences in one row, but the state restarts from zero at each
  sequence boundary: only the row's first sequence could start from a given state;
- ``cu_seqlens`` serves only ``return_varlen_states=True`` (per-sequence final states), and the
  backward asserts ``not return_varlen_states``: those final states are not differentiable.

So a bucket of pieces runs as one call with **one piece per batch row**, right-padded to the
bucket's longest piece, ``initial_states`` the pieces' parents' final states and
``return_final_states=True`` (its backward returns the initial states' gradient and consumes the
final states'). Padding must not move a final state: ``dt`` goes in already discretized
(:func:`~.ssd_torch.discretize_dt`, so ``dt_bias=None, dt_softplus=False`` and the default
``dt_limit``), and the padding tokens carry ``dt = x = B = C = 0``, which leave the state as it
is. The construction is a function of its own (:func:`chunk_scan_arguments`) so that it is tested
on CPU against a stand-in of the documented semantics; ``mamba_ssm`` is imported only when the
kernel is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .torch_kernels import _padded, _padded_index

__all__ = ["MAMBA_CHUNK_SIZE", "chunk_scan_arguments", "chunk_ssd_mamba"]

MAMBA_CHUNK_SIZE = 256  # mamba_ssm's Mamba2 default; any chunk size gives the same scan


def chunk_scan_arguments(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens_host: Sequence[int],
    chunk_size: int = MAMBA_CHUNK_SIZE,
) -> tuple[dict[str, Any], torch.Tensor]:
    """``(keywords, keep)``: the keywords of ``mamba_chunk_scan_combined`` for token-major
    inputs (shapes as :func:`~prefix_sharing.recurrent.ssd.chunk_ssd`), one sequence per batch
    row, and ``keep``, the padded ``(batch * seqlen)`` positions that hold the real tokens in
    token order (``out.flatten(0, 1).index_select(0, keep)``)."""
    index, keep = _padded_index(cu_seqlens_host, x.size(0), 1, x.device)  # [n, L]
    args = dict(x=_padded(x, index), dt=_padded(dt, index), A=A, B=_padded(B, index),
                C=_padded(C, index), chunk_size=chunk_size, D=D, z=None, dt_bias=None,
                initial_states=None if initial_state is None else initial_state.float(),
                seq_idx=None, dt_softplus=False, return_final_states=True)
    return args, keep


def chunk_ssd_mamba(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, *, output_final_state: bool = False,
                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """mamba_ssm's chunked scan; arguments as :func:`chunk_scan_arguments`."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    args, keep = chunk_scan_arguments(x, dt, A, B, C, **kwargs)
    out, final = mamba_chunk_scan_combined(**args)
    return out.flatten(0, 1).index_select(0, keep), final if output_final_state else None
