"""Megatron core attention that injects each reuser's prefix K/V from its provider's rows."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from ..attention import prefix_attention, varlen_attention
from ..attention.backends import (CAUSAL_KEYS_ONLY_SEGMENTS, READS_HOST_BOUNDARIES,
                                  get_lse_kernel, resolve_backend)
from ..attention.merge import attention_over_sources
from ..attention.sources import runnable_layout
from ..refusals import refuse
from .checks import UnsupportedSetupError, check_layer_config, check_sharing_allowed
from .context_parallel import gather_rows
from .packed_seq import PlanPackedSeqParams

__all__ = ["PrefixSharingCoreAttention", "require_sharing_core_attention"]


class PrefixSharingCoreAttention(DotProductAttention):
    """Core attention for packed (THD) micro-batches, with prefix sharing.

    Shapes (this tensor-parallel rank's heads; ``T`` = flat tokens of the micro-batch):
        query ``[T, np, hn]``, key/value ``[T, ng, hn]`` -> output ``[T, np * hn]``; under
        multi-latent attention (``k_channels`` / ``v_channels`` given, see :mod:`.mla`) query
        and key ``[T, np, k_channels]``, value ``[T, np, v_channels]`` -> ``[T, np *
        v_channels]``, the kernels taking the two head dims as they can (flash-attn 2 with V
        zero-padded to the key's head dim, then trimmed).

    With a :class:`PlanPackedSeqParams`, every query segment attends to its whole sequence: its
    provider's prefix rows are gathered into the segment's keys and values (``kv_gather_index``),
    causal aligned bottom-right. With Megatron's plain ``PackedSeqParams`` it is ordinary THD
    attention, and without packed params it is Megatron's own ``DotProductAttention``.

    Constructed by ``build_module`` with megatron-core's core-attention keywords; register it
    through :func:`prefix_sharing.megatron_ext.with_prefix_sharing`.

    Sliding windows and sinks come from the config as megatron's own attention reads them:
    ``window_size=(left, 0)`` on the layers ``window_attn_skip_freq`` makes windowed (each
    query sees ``left + 1`` keys, on logical positions, so a reuser's gather is trimmed to the
    prefix keys its window reaches), and ``softmax_type`` ``"learnable"`` / ``"off-by-one"`` as
    per-head sinks (``softmax_offset``, this rank's heads under tensor parallelism; the torch
    kernel only, see :mod:`prefix_sharing.attention`).

    Under context parallelism the query rows are this rank's slice; keys and values of the
    whole flat layout are all-gathered over the CP group and each local query piece attends to
    its segment's gathered keys (see :mod:`.context_parallel`), with the same local kernel,
    window and sinks (the gather is not trimmed to the window there).

    Each layer keeps its own kernel state (``kernel_cache``: Transformer Engine's attention
    module, built at the first call), as megatron's own TE attention does. FP8 attention
    (``config.fp8``) is refused with the TE kernel: this package has not validated it.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ) -> None:
        check_layer_config(config)  # before super(), whose context-parallel assert is misleading
        # megatron's DotProductAttention asserts context_parallel_size == 1 (its own attention
        # cannot split a sequence); this class does its own CP communication, so the parent is
        # built on a copy that says 1 and the layer then keeps the real config.
        parent_config = copy.copy(config)
        parent_config.context_parallel_size = 1
        super().__init__(
            config=parent_config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        self.config = config
        if k_channels is not None or v_channels is not None:
            # multi-latent attention: query/key and value head dims of their own (192 / 128 on
            # DeepSeek-V3), which megatron passes to core attentions that accept them (TE's);
            # the output is one v_channels row per head, also on the parent's padded path
            self.hidden_size_per_attention_head = k_channels or self.hidden_size_per_attention_head
            self.hidden_size_per_partition = (
                (v_channels or self.hidden_size_per_attention_head)
                * self.num_attention_heads_per_partition
            )
        # Megatron divides the scale by the layer number under query-key layer scaling and
        # multiplies it back inside the softmax; the kernels take the net scale.
        self.net_softmax_scale = self.softmax_scale * (
            self.layer_number if config.apply_query_key_layer_scaling else 1
        )
        # keys each query sees on a windowed layer (None: full causal)
        self.window = (
            config.window_size[0] + 1
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                         layer_number) and config.window_size[0] >= 0
            else None
        )
        if config.softmax_type == "learnable":
            # split with the heads: each rank holds its heads' sinks (megatron-core 0.16.1 does
            # not mark it, so grad-norm and weight seeding would take it for a replica)
            tensor_parallel.set_tensor_model_parallel_attributes(
                self.softmax_offset, is_parallel=True, dim=0, stride=1
            )
        # A plain dict, not a submodule: the layer's state_dict stays that of the stock layer.
        self.kernel_cache: dict[Any, Any] = {}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if (packed_seq_params is None or packed_seq_params.qkv_format != "thd") and (
            self.config.context_parallel_size == 1
        ):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params,
            )
        if attention_bias is not None:
            raise refuse("megatron.attention_bias", error=UnsupportedSetupError)
        if self.training and self.attention_dropout.p > 0:
            raise refuse("megatron.attention_dropout",
                         f"attention_dropout={self.attention_dropout.p}",
                         error=UnsupportedSetupError)
        if self.config.context_parallel_size > 1 and not (
            isinstance(packed_seq_params, PlanPackedSeqParams) and packed_seq_params.cp is not None
        ):
            raise refuse("megatron.context_parallel.unplanned_input",
                         f"context_parallel_size={self.config.context_parallel_size}",
                         error=UnsupportedSetupError)
        backend = self._resolve_backend(packed_seq_params, query)
        if isinstance(packed_seq_params, PlanPackedSeqParams):
            plan = packed_seq_params.plan
            check_sharing_allowed(self.config, plan, self.training)
            if packed_seq_params.cp is not None:
                out = self._context_parallel(query, key, value, packed_seq_params, backend)
                return out.reshape(out.size(0), -1)  # [T_local, np, hn] -> [T_local, np * hn]
            stored = []
            if packed_seq_params.prefix_kv is not None:  # a group's prefix across micro-batches
                stored, key, value = packed_seq_params.prefix_kv.key_sources(
                    self.layer_number, key, value)
            out = prefix_attention(
                query, key, value, plan, softmax_scale=self.net_softmax_scale,
                window=self.window, sinks=self.softmax_offset, backend=backend,
                kernel_cache=self.kernel_cache, stored=stored,
            )
        else:
            out = self._plain_thd(query, key, value, packed_seq_params, backend)
        return out.reshape(out.size(0), -1)  # [T, np, hn] -> [T, np * hn]

    def _context_parallel(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: PlanPackedSeqParams,
        backend: str,
    ) -> torch.Tensor:
        """This CP rank's query rows against their segments' keys, gathered from every rank
        (and, across micro-batches, the group's prefix K/V in front: see
        :mod:`.cross_context_parallel`).

        The all-gathered K/V hold the plan's flat rows, once each. Where the backend's with-lse
        kernel takes causal segments without queries (:data:`~prefix_sharing.attention.
        backends.CAUSAL_KEYS_ONLY_SEGMENTS`: the rows before and after this rank's pieces), the
        local rows attend over them in place, every peer's rows a key source
        (:func:`~prefix_sharing.attention.sources.runnable_layout` with ``rows``; a window
        bounds each reader row's keys of a node where the kernel takes a first key per row):
        no per-reader copy. Otherwise (flash-attn, TE; a window cutting a node on torch_npu; a
        group's stored prefix in front) each local query piece's keys are gathered."""
        cp = params.cp
        if query.size(0) != cp.num_rows:
            raise ValueError(
                f"q has {query.size(0)} tokens but this context-parallel rank holds "
                f"{cp.num_rows} rows of the plan"
            )
        # [T_local, ng, hn] -> [T_flat, ng, hn] (all-gather; dK, dV reduce-scattered back)
        key, value = gather_rows(key, cp), gather_rows(value, cp)
        if params.prefix_kv is not None:  # a block records them whole; a suffix reads its stack
            key, value = params.prefix_kv.exchange(self.layer_number, key, value)
        if params.prefix_kv is None and backend in CAUSAL_KEYS_ONLY_SEGMENTS:
            layout = runnable_layout(params.plan, backend, rows=(cp.row_start, cp.row_stop),
                                     window=self.window)
            if layout is not None:
                out, _ = attention_over_sources(query, key, value, layout,
                                                get_lse_kernel(backend), self.net_softmax_scale,
                                                sinks=self.softmax_offset)
                return out
        key = key.index_select(0, cp.kv_gather_index)  # [sum of local key ranges, ng, hn]
        value = value.index_select(0, cp.kv_gather_index)
        # A local query piece's keys are its segment's first keys in logical order, ending at
        # its last query, so the bottom-right band of a window and the sinks are the plain ones.
        return varlen_attention(
            query, key, value, cp.cu_seqlens_q, cp.cu_seqlens_kv, cp.max_seqlen_q,
            cp.max_seqlen_kv, self.net_softmax_scale, window=self.window,
            sinks=self.softmax_offset, backend=backend,
            cu_seqlens_q_host=cp.cu_seqlens_q_host, cu_seqlens_k_host=cp.cu_seqlens_kv_host,
            kernel_cache=self.kernel_cache,
        )

    def _resolve_backend(self, params: PackedSeqParams, query: torch.Tensor) -> str:
        backend = resolve_backend(getattr(params, "backend", "auto"), query.device, query.dtype)
        if backend == "te" and self.config.fp8:
            raise refuse("megatron.te_fp8", f"config.fp8={self.config.fp8!r}",
                         error=UnsupportedSetupError)
        return backend

    def _plain_thd(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: PackedSeqParams,
        backend: str,
    ) -> torch.Tensor:
        """Megatron's own THD layout (e.g. verl's): segments as laid out in the tensors.

        With ``*_padded`` boundaries each sequence's pad tokens follow its real ones, so causal
        attention over the padded segment leaves the real tokens' outputs unchanged.
        """
        cu_q = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
        cu_kv = params.cu_seqlens_kv if params.cu_seqlens_kv_padded is None else params.cu_seqlens_kv_padded
        host = _host_boundaries(params, cu_q, cu_kv, backend in READS_HOST_BOUNDARIES)
        return varlen_attention(
            query, key, value, cu_q, cu_kv, host.max_seqlen_q, host.max_seqlen_kv,
            self.net_softmax_scale, window=self.window, sinks=self.softmax_offset,
            backend=backend, cu_seqlens_q_host=host.cu_seqlens_q,
            cu_seqlens_k_host=host.cu_seqlens_kv, kernel_cache=self.kernel_cache,
        )


@dataclasses.dataclass(frozen=True)
class _HostBoundaries:
    max_seqlen_q: int
    max_seqlen_kv: int
    cu_seqlens_q: tuple[int, ...] | None
    cu_seqlens_kv: tuple[int, ...] | None


_HOST_ATTR = "_prefix_sharing_host_boundaries"


def _host_boundaries(
    params: PackedSeqParams, cu_q: torch.Tensor, cu_kv: torch.Tensor, need_lists: bool
) -> _HostBoundaries:
    """What the kernels need on the host, read from the device at most once per micro-batch.

    The same ``params`` object reaches every layer, so the first layer caches the result on it.
    ``max_seqlen_*`` come from the params when set (megatron's contract: the longest segment,
    padding included); the boundary lists only when the kernel reads them (torch, npu, flex).
    """
    cached = getattr(params, _HOST_ATTR, None)
    if cached is not None and (cached.cu_seqlens_q is not None or not need_lists):
        return cached
    lists = (tuple(cu_q.tolist()), tuple(cu_kv.tolist())) if need_lists else (None, None)
    if params.max_seqlen_q is not None and params.max_seqlen_kv is not None:
        max_q, max_kv = int(params.max_seqlen_q), int(params.max_seqlen_kv)
    elif need_lists:
        max_q = max(b - a for a, b in zip(lists[0][:-1], lists[0][1:]))
        max_kv = max(b - a for a, b in zip(lists[1][:-1], lists[1][1:]))
    else:  # one read for both
        max_q, max_kv = torch.stack([(cu[1:] - cu[:-1]).max() for cu in (cu_q, cu_kv)]).tolist()
    cached = _HostBoundaries(max_q, max_kv, *lists)
    setattr(params, _HOST_ATTR, cached)
    return cached


def require_sharing_core_attention(attention: Any) -> None:
    """Refuses an attention layer whose spec gave it a stock core attention: that one would
    attend without the shared prefix's keys."""
    if not isinstance(attention.core_attention, PrefixSharingCoreAttention):
        raise refuse("megatron.stock_core_attention",
                     f"{type(attention).__qualname__} (layer {attention.layer_number}) has "
                     f"{type(attention.core_attention).__qualname__}",
                     error=UnsupportedSetupError)
