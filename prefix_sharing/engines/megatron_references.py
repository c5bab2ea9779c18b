"""The Megatron engine's stock references, and the patches for megatron-core's own gaps.

- ``"packed"``: megatron's stock THD layout (:func:`stock_thd_batch`, plain
  ``PackedSeqParams``, verl's packing), its log-probs read with the shared step's code
  (:func:`stock_thd_token_stats`);
- ``"padded"``: megatron's stock local spec on right-padded ``[b, s]`` input
  (:func:`padded_batch`), routes replayed through each stock router
  (:func:`replay_padded`), the padding mask cut for later pipeline stages
  (:func:`stage_padding_mask`);
- the gaps megatron-core leaves on a CPU or in its stock spec, filled so the padded reference
  builds and runs (:func:`padded_reference_spec`, :func:`gdn_on_cpu`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..config import PrefixSharingConfig

__all__ = ["clear_replay", "gdn_on_cpu", "padded_batch", "padded_reference_spec", "replay_padded",
           "routers_replaying", "stage_padding_mask", "stock_thd_batch", "stock_thd_token_stats"]


def padded_reference_spec(spec: Any, config: Any) -> Any:
    """The stock spec, two gaps of megatron-core's own filled so the padded reference builds
    and runs on CPU:

    - multi-latent attention's core attention is built with ``k_channels`` / ``v_channels``,
      which only megatron's Transformer Engine attention accepts: here megatron's
      ``DotProductAttention`` told the value head dim (:func:`_mla_dot_product_attention`);
    - with an expert bias, megatron's ``TopKRouter._apply_expert_bias`` masks the
      ``[tokens, experts]`` routing map with the ``[tokens]`` padding mask, which does not
      broadcast (0.16.1 - 0.19.2): here the mask per token (:func:`_padded_router`).
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    from ..megatron_ext.spec_surgery import mlp_with_router, moe_router, replaced

    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    swapped = []
    for layer in layers:
        if config.multi_latent_attention:
            attention = replaced(layer.submodules.self_attention,
                                 core_attention=ModuleSpec(module=_mla_dot_product_attention()))
            layer = replaced(layer, self_attention=attention)
        mlp = layer.submodules.mlp
        router = moe_router(mlp)
        if config.moe_router_enable_expert_bias and router is not None:
            layer = replaced(layer, mlp=mlp_with_router(mlp, _padded_router(router)))
        swapped.append(layer)
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=swapped)
    return swapped[0]


@functools.cache
def _padded_router(router: type) -> type:
    """``router`` (megatron's ``TopKRouter``) counting expert-bias tokens with the padding mask
    per token, as megatron intends (its own line does not broadcast)."""

    class PaddedRouter(router):  # type: ignore[misc, valid-type]
        def _apply_expert_bias(self, routing_map: torch.Tensor,
                               padding_mask: torch.Tensor | None = None) -> None:
            mask = None if padding_mask is None else padding_mask.reshape(-1, 1)
            super()._apply_expert_bias(routing_map, mask)

    return PaddedRouter


@functools.cache
def _mla_dot_product_attention() -> type:
    """Megatron's ``DotProductAttention`` taking MLA's ``k_channels`` / ``v_channels``, with
    the value head dim as its output width per head (its math takes any value width; only
    its output view assumes ``kv_channels``)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        # megatron's Attention base class first builds it without the two
        def __init__(self, *args: Any, k_channels: int | None = None,
                     v_channels: int | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def gdn_on_cpu(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Megatron's stock GDN layers on a CPU: its torch path (``deterministic_mode``: a torch
    ``conv1d`` and megatron's ``torch_chunk_gated_delta_rule``, set by
    :func:`.megatron_models.hybrid_model`; fla's Triton kernels need a GPU). That rule computes
    in float32 whatever its inputs, so a float64 reference model's GDN layers run the
    project's torch rule instead, which keeps float64 (it is checked against a token-by-token
    recurrence in ``tests/recurrent``)."""
    from ..recurrent.batch_major import gated_delta_rule_batch_major

    if dtype != torch.float64:
        return
    for module in model.modules():
        if hasattr(module, "gated_delta_rule"):
            module.gated_delta_rule = gated_delta_rule_batch_major


def stock_thd_batch(sequences: Sequence[torch.Tensor], device: Any = None,
                    backend: str = "auto") -> tuple[Any, Any]:
    """Megatron's stock THD inputs for a micro-batch, and what its log-probs are read with.

    Returns ``(inputs, stats_batch)``: ``inputs`` is
    :func:`~prefix_sharing.megatron_ext.packed_seq.plain_micro_batch` (plain ``PackedSeqParams``,
    each sequence padded to the tensor-parallel size), ``stats_batch`` a ``MicroBatch`` of the
    nothing-shared plan, whose flat layout is exactly the real tokens ``inputs.token_rows``
    picks: :func:`stock_thd_token_stats` reads the log-probs with the same code as the shared
    step, so the two steps differ only in what sharing changes. ``backend``: the attention
    kernel (the core attention reads a ``backend`` attribute of plain ``PackedSeqParams`` too).
    """
    from ..megatron_ext import prepare_micro_batch
    from ..megatron_ext.packed_seq import plain_micro_batch

    inputs = plain_micro_batch(sequences, device=device)
    inputs.packed_seq_params.backend = backend
    stats_batch = prepare_micro_batch(sequences, PrefixSharingConfig(mode="off"),
                                      pad_to_multiple_of=1, device=device)
    return inputs, stats_batch


def stock_thd_token_stats(logits: torch.Tensor, inputs: Any, stats_batch: Any) -> Any:
    """Per-token log-probs and entropy from the stock THD logits ``[1, T_padded, V_local]``."""
    from ..megatron_ext import token_stats

    if logits.size(1) != inputs.token_rows.numel():  # drop each sequence's pad rows
        logits = logits.index_select(1, inputs.token_rows)
    return token_stats(logits, stats_batch)



def padded_batch(seqs: Sequence[torch.Tensor], device: Any) -> tuple[torch.Tensor, ...]:
    """Right-padded ``[b, s]`` tokens, positions and padding mask (True at pads); causal
    attention keeps pads out of reach. ``s`` is the longest sequence rounded up to a multiple
    of the tensor-parallel size, which sequence parallelism splits ``s`` by."""
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    longest = max(len(s) for s in seqs)
    longest += -longest % tp_size
    tokens = torch.zeros(len(seqs), longest, dtype=torch.long)
    padding = torch.ones(len(seqs), longest, dtype=torch.bool)
    for row, s in enumerate(seqs):
        tokens[row, : len(s)] = s
        padding[row, : len(s)] = False
    positions = torch.arange(longest).expand(len(seqs), longest)
    return tokens.to(device), positions.to(device), padding.to(device)


def routers_replaying(model: torch.nn.Module) -> list[Any]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules()
            if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None]


def replay_padded(model: torch.nn.Module, routes: Sequence[torch.Tensor], length: int) -> None:
    """Sets every stock router of this stage to replay ``routes`` (per sequence ``[L_i,
    moe_layers or layers, topk]``, the column as ``route_column`` picks it) on the right-padded
    ``[b, length]`` batch: the router's top-k sees ``[s, b]`` flattened s-major, under sequence
    parallelism this rank's slice of ``s``; pad positions replay experts ``0..topk-1`` (their
    outputs are never read)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from ..megatron_ext.routing_replay import route_column

    routers = routers_replaying(model)
    if not routers:
        raise ValueError("routes were given but no router of this model replays: build it with "
                         "moe_enable_routing_replay=True")
    _, moe_layers, topk = routes[0].shape
    padded = torch.arange(topk).expand(len(routes), length, moe_layers, topk).clone()
    for row, r in enumerate(routes):
        padded[row, : r.size(0)] = r
    plain = padded.transpose(0, 1)  # [s, b, moe_layers, topk]
    if model.config.sequence_parallel:
        plain = plain.chunk(parallel_state.get_tensor_model_parallel_world_size())[
            parallel_state.get_tensor_model_parallel_rank()]
    for router in routers:
        column = plain[:, :, route_column(model.config, router.layer_number, moe_layers)]
        router.router_replay.set_target_indices(column.reshape(-1, topk).to(router.weight.device))
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def stage_padding_mask(model: torch.nn.Module, padding: torch.Tensor) -> torch.Tensor:
    """The ``[b, s]`` padding mask as this stage's MoE layers need it.

    Under sequence parallelism megatron-core's ``GPTModel.forward`` cuts this rank's ``s / TP``
    slice of the mask with the embedding, on the first pipeline stage only; a later stage would
    hand its routers the whole mask for a slice of the tokens. ``HybridModel.forward`` never
    cuts it. So those stages get the slice here.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    cut_by_the_model = isinstance(model, GPTModel) and model.pre_process
    if cut_by_the_model or not model.config.sequence_parallel:
        return padding
    return scatter_to_sequence_parallel_region(padding.transpose(0, 1).contiguous()).transpose(0, 1)


def clear_replay(model: torch.nn.Module) -> None:
    """Takes back what :func:`replay_padded` set on every stock router of this stage."""
    for router in routers_replaying(model):
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()
