"""Multi-token prediction (MTP) on the flat layout: one plan per prediction depth.

An MTP layer at depth ``k`` computes row ``t`` of a sequence from the row's hidden state at
depth ``k - 1`` and the embedding of token ``t + k``, attending causally over the rows before
it (megatron-core's ``MultiTokenPredictionLayer``; DeepSeek-V3). Its value at row ``t``
therefore depends on tokens ``0 .. t + k``: two sequences that agree on their first ``P``
tokens share rows ``0 .. P - k - 1`` at depth ``k``, and each computes its own last ``k``
prefix rows. That is exactly the plan of the tokens tagged with their next ``k`` tokens (a
tag past a sequence's end says so), built as a plan with recorded routes is built: the
planner shares a row only where the tags agree too.

So every depth has its own plan (``plan_mtp_depths``, on the host, once per micro-batch), and
an :class:`MTPDepth` says how depth ``k`` reads depth ``k - 1``: each of its flat rows takes
the hidden state of the depth ``k - 1`` row that computed the same (sequence, position), its
own token ``t + k`` (megatron's rolled ``input_ids``: 0 past the end), and its loss term is
each reader's label ``t + k + 1`` weighted by the reader's loss mask at ``t + k``, as
megatron rolls its labels and loss mask along each plain sequence.

Megatron's block (``MultiTokenPredictionBlock``) is kept; its layers are
:class:`PrefixSharingMTPLayer` (the spec swaps the class, :func:`.layer_specs.with_prefix_sharing`),
and the model's ``_postprocess`` is replaced by :func:`share_multi_token_prediction`: the stock
one rolls labels along the flat rows and splits the block's output into equal chunks, neither
of which holds on a flat layout whose depths differ in length.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer import multi_token_prediction
from megatron.core.transformer.multi_token_prediction import (MTPLossAutoScaler,
                                                              MTPLossLoggingHelper,
                                                              MultiTokenPredictionLayer)
from megatron.core.utils import make_viewless_tensor, unwrap_model

from ..config import PrefixSharingConfig
from ..plan import SharingPlan
from ..planner import PromptGroup, TokenSequence, build_plan
from .context_parallel import ContextParallelSlice, gather_rows, slice_plan
from .vocab_parallel import rows_token_stats, vocab_shard

__all__ = ["MTPDepth", "PrefixSharingMTPLayer", "plan_mtp_depths", "share_multi_token_prediction"]

# megatron-core 0.19 threads a padding mask through the MTP layer (and returns it)
_EMBEDDINGS_RETURN_PADDING_MASK = "padding_mask" in inspect.signature(
    MultiTokenPredictionLayer._get_embeddings).parameters
# megatron-core 0.19's per-token MTP loss (process_mtp_loss) rescales each depth from its rolled
# token count to the loss mask's; 0.16's attaches the plain sum
_PER_TOKEN_LOSS_RESCALED = hasattr(multi_token_prediction, "process_mtp_loss")
# megatron-core 0.16's MTP checkpoint takes the function and hands every keyword to
# tensor_parallel.checkpoint as a tensor to save
_CHECKPOINT_SAVES_KEYWORDS = "forward_func" in inspect.signature(
    MultiTokenPredictionLayer._checkpointed_forward).parameters


@dataclasses.dataclass(frozen=True)
class MTPDepth:
    """How MTP depth ``k`` lays out and reads its rows (tensors on the model's device).

    Attributes:
        plan: the depth's plan (on the model's device).
        cp: this context-parallel rank's slice of it, or ``None``.
        input_ids: ``[1, T_k]`` the token each flat row embeds, ``t + k`` of its sequence (0
            past the end), as megatron's ``roll_tensor`` gives it ``k`` rolls along a sequence
            (under context parallelism this rank's rows only, ``[1, T_k / CP]``).
        position_ids: the rolled positions, likewise (learned position embeddings).
        from_previous: ``(T_k,)`` for each flat row, the row of depth ``k - 1`` (the decoder's
            layout for ``k = 1``) that computed the same (sequence, position).
        targets: ``(T_total,)`` each position's depth-``k`` label, token ``t + k + 1`` (0 past the
            end), packed in the plan's sequence order.
        weights: ``(T_total,)`` float, each position's loss mask at ``t + k`` (0 past the end).
        mask_tokens: ``()`` float, the loss mask's sum before any roll (megatron's per-token
            loss rescales each depth to it).
    """

    plan: SharingPlan
    cp: ContextParallelSlice | None
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    from_previous: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    mask_tokens: torch.Tensor

    def params(self, decoder: Any) -> Any:
        """The depth's ``PlanPackedSeqParams``, made like the decoder's ``decoder`` (a few
        host fields; every layer's forward makes its own, so nothing stays on the depth)."""
        return type(decoder).from_plan(self.plan, decoder.backend, cp=self.cp)


def plan_mtp_depths(
    sequences: Sequence[TokenSequence],
    plan: SharingPlan,
    num_layers: int,
    config: PrefixSharingConfig,
    *,
    groups: Sequence[PromptGroup] | None = None,
    pad_to_multiple_of: int = 1,
    loss_mask: Sequence[TokenSequence] | None = None,
    device: torch.device | str = "cpu",
    cp_group: torch.distributed.ProcessGroup | None = None,
) -> tuple[MTPDepth, ...]:
    """The layouts of MTP depths ``1 .. num_layers`` of a micro-batch planned as ``plan`` (host
    work, once per micro-batch; see the module doc).

    Args:
        sequences: the micro-batch's token ids, as given to the planner.
        plan: the decoder's plan of them (on the host).
        num_layers: the model's ``mtp_num_layers``.
        config, groups, pad_to_multiple_of: as the decoder's plan was built with.
        loss_mask: one 0/1 (or weight) array per sequence, megatron's ``loss_mask`` (position
            ``t`` weighs the prediction of token ``t + 1``); default: 1 everywhere but each
            sequence's last position, which has nothing to predict.
        cp_group: the context-parallel group (more than one rank): each depth's rows are split
            over it as the decoder's are (:func:`.context_parallel.slice_plan`), and this
            rank's :class:`MTPDepth` holds its slice's ids and positions.
    """
    lengths = np.asarray(plan.seq_lens, dtype=np.int64)
    tokens = plan.token_ids.cpu().numpy()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    position = np.arange(tokens.size) - np.repeat(starts, lengths)  # t of each packed position
    remaining = np.repeat(lengths, lengths) - position  # tokens from t to the end, t included
    mask = _loss_mask(loss_mask, lengths)
    previous_rows = plan.kv_index.cpu().numpy()
    depths, ahead = [], []
    for k in range(1, num_layers + 1):
        # each token tagged with its next k tokens (+1; 0 past the end): shared where they agree
        ahead.append(_rolled(tokens + 1, remaining, k))
        tags = np.stack(ahead, axis=1)
        depth_groups = None if groups is None else [
            PromptGroup(max(g.prompt_len - k, 0), g.members) for g in groups]
        depth_plan = build_plan(sequences, config, groups=depth_groups,
                                pad_to_multiple_of=pad_to_multiple_of,
                                routes=list(np.split(tags, np.cumsum(lengths)[:-1])))
        rows = depth_plan.kv_index.numpy()
        owner = np.zeros(depth_plan.num_tokens_flat, dtype=np.int64)  # pad rows: position 0
        owner[rows] = np.arange(rows.size)
        cp = None if cp_group is None else slice_plan(
            depth_plan, torch.distributed.get_rank(cp_group),
            torch.distributed.get_world_size(cp_group), cp_group, device)
        local = slice(None) if cp is None else slice(cp.row_start, cp.row_stop)
        depths.append(MTPDepth(
            plan=depth_plan.to(device), cp=cp,
            input_ids=_device(_rolled(tokens, remaining, k)[owner][local], device).unsqueeze(0),
            position_ids=_device(_rolled(position, remaining, k)[owner][local],
                                 device).unsqueeze(0),
            from_previous=_device(previous_rows[owner], device),
            targets=_device(_rolled(tokens, remaining, k + 1), device),
            weights=_device(_rolled(mask, remaining, k), device),
            mask_tokens=_device(mask.sum(), device),
        ))
        previous_rows = rows
    return tuple(depths)


def _rolled(values: np.ndarray, remaining: np.ndarray, k: int) -> np.ndarray:
    """``values`` rolled ``k`` positions left along each sequence, 0 past its end (megatron's
    ``roll_tensor`` applied ``k`` times to a packed sequence)."""
    ahead = values[np.minimum(np.arange(values.size) + k, values.size - 1)]
    return np.where(k < remaining, ahead, 0).astype(values.dtype)


def _loss_mask(loss_mask: Sequence[TokenSequence] | None, lengths: np.ndarray) -> np.ndarray:
    if loss_mask is None:
        mask = np.ones(int(lengths.sum()), dtype=np.float32)
        mask[np.cumsum(lengths) - 1] = 0
        return mask
    if len(loss_mask) != lengths.size:
        raise ValueError(f"loss_mask must be one array per sequence ({lengths.size}); "
                         f"got {len(loss_mask)}")
    parts = [np.asarray(m.cpu() if isinstance(m, torch.Tensor) else m, dtype=np.float32)
             for m in loss_mask]
    for i, (part, n) in enumerate(zip(parts, lengths.tolist())):
        if part.shape != (n,):
            raise ValueError(f"loss_mask {i} must have one entry per token ({n}); "
                             f"got shape {part.shape}")
    return np.concatenate(parts)


def _device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


def mtp_depth(packed_seq_params: Any, depth: int) -> MTPDepth:
    """Depth ``depth``'s layout of a sharing forward (1-based), or a clear error."""
    depths = getattr(packed_seq_params, "mtp", ())
    if len(depths) < depth:
        raise ValueError(
            f"the model has an MTP layer at depth {depth}, and the micro-batch was planned for "
            f"{len(depths)} depths: pass prepare_micro_batch(..., mtp_num_layers="
            f"config.mtp_num_layers)")
    return depths[depth - 1]


class PrefixSharingMTPLayer(MultiTokenPredictionLayer):
    """Megatron's MTP layer on the flat layout of its depth (module doc).

    It takes the previous depth's rows and re-lays them out as its own depth's plan (one
    gather, differentiable), embeds the depth's rolled tokens instead of rolling the flat
    rows, and runs megatron's projection and transformer layer on the depth's plan. With
    megatron's plain ``PackedSeqParams`` (nothing shared) it is megatron's layer.

    ``detach_encoder`` (set by :func:`share_multi_token_prediction`): the MTP loss trains
    neither the embedding nor the main decoder, whose rows the first depth reads; a later
    depth reads the previous MTP layer's rows and keeps their graph (verl's
    ``mtp.detach_encoder``).
    """

    detach_encoder = False

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                hidden_states: torch.Tensor, attention_mask: Any, *args: Any,
                packed_seq_params: Any = None, **kwargs: Any) -> tuple:
        if getattr(packed_seq_params, "plan", None) is None:
            return super().forward(input_ids, position_ids, hidden_states, attention_mask,
                                   *args, packed_seq_params=packed_seq_params, **kwargs)
        depth = mtp_depth(packed_seq_params, self.layer_number)
        hidden, _, _, *rest = super().forward(
            depth.input_ids, depth.position_ids, self._relaid(hidden_states, depth),
            attention_mask, *args, packed_seq_params=depth.params(packed_seq_params), **kwargs)
        # the next depth re-lays its ids out itself; megatron-core 0.19 also returns the
        # padding mask (None on a planned micro-batch)
        return (hidden, input_ids, position_ids, *rest)

    def _relaid(self, hidden_states: torch.Tensor, depth: MTPDepth) -> torch.Tensor:
        """This rank's rows of the depth's layout from its rows of the previous depth's (split
        over sequence- and context-parallel ranks as the decoder's are).

        The whole previous layout is gathered (its sequence-parallel slices, then its context-
        parallel ones), re-laid out, and this rank keeps its slice. Each rank's gradient then
        covers only its own slice, and the gathers' backward sums the ranks' shares.
        """
        cp = depth.cp
        if self.config.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states)
        if cp is not None:
            hidden_states = gather_rows(hidden_states, cp)
        hidden_states = hidden_states.index_select(0, depth.from_previous)
        if cp is not None:
            hidden_states = hidden_states[cp.row_start:cp.row_stop]
        if self.config.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            hidden_states = hidden_states.chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
        return hidden_states

    def _get_embeddings(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                        embedding: Any, hidden_states: torch.Tensor,
                        packed_seq_params: Any = None, **padding_mask: Any) -> tuple:
        """Megatron's, without the roll when the ids are already the depth's (planned).
        ``padding_mask``: megatron-core 0.19's keyword (the signature is the release's)."""
        if getattr(packed_seq_params, "plan", None) is None:
            return super()._get_embeddings(input_ids, position_ids, embedding, hidden_states,
                                           packed_seq_params, **padding_mask)
        padding_mask = padding_mask.get("padding_mask")
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        if self.detach_encoder or getattr(self.config, "mtp_detach_heads", False):
            decoder_input = decoder_input.detach()
        if self.detach_encoder and self.layer_number == 1:  # the main decoder's rows
            hidden_states = hidden_states.detach().requires_grad_()
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if _EMBEDDINGS_RETURN_PADDING_MASK:
            return input_ids, position_ids, padding_mask, decoder_input, hidden_states
        return input_ids, position_ids, decoder_input, hidden_states

    # callers read which keywords the layer takes (verl's detach patch), as megatron's
    _get_embeddings.__signature__ = inspect.signature(MultiTokenPredictionLayer._get_embeddings)

    if _CHECKPOINT_SAVES_KEYWORDS:
        def _checkpointed_forward(self, forward_func: Any, *args: Any, **kwargs: Any) -> Any:
            """Megatron's full recompute of the layer, given only the tensor arguments to
            checkpoint: megatron-core 0.16 hands it every keyword, and a packed micro-batch's
            params (the plan's, or megatron's own) are not a tensor it can save. The other
            arguments are closed over, as the decoder's recompute does."""
            names = [name for name, value in kwargs.items() if torch.is_tensor(value)]
            others = {name: value for name, value in kwargs.items() if name not in names}

            def run(*tensors: torch.Tensor) -> Any:
                return forward_func(*args, **others, **dict(zip(names, tensors)))

            return super()._checkpointed_forward(run, *(kwargs[name] for name in names))


def share_multi_token_prediction(model: torch.nn.Module, *, detach_head: bool = False,
                                 detach_encoder: bool = False) -> torch.nn.Module:
    """Makes ``model`` (a ``GPTModel``, or a wrapper of one) score its MTP depths on their own
    layouts in a sharing forward; returns ``model``.

    The stock ``GPTModel._postprocess`` reads per-sequence ``labels`` laid out along the flat
    rows and splits the MTP block's output into equal chunks; on a sharing forward this one
    splits it by the depths' row counts, scores each depth's rows against each reader's
    label (:class:`MTPDepth`), attaches the losses to the decoder's hidden states as megatron
    does (``MTPLossAutoScaler``: their gradient flows in the same backward) and logs them, then
    returns the logits as the stock one does without labels. Other forwards run the stock one.

    MTP layers built from a stock MTP block spec whose transformer layer is the sharing one
    (Megatron-Bridge derives the MTP block spec from the layer spec inside its provider)
    become :class:`PrefixSharingMTPLayer`: it holds no state of its own, only its forward, so
    this is the layer the sharing spec would have built. A subclass of megatron's layer is left
    as it is (the model check refuses it).

    Args:
        detach_head: the MTP loss does not train the output layer (megatron-core 0.19's
            ``mtp_detach_heads`` does the same; verl's MTP training on releases without
            megatron's ``process_mtp_loss``).
        detach_encoder: the MTP loss trains neither the embedding nor the main decoder
            (verl's ``mtp.detach_encoder``).
    """
    gpt = unwrap_model(model)
    gpt = getattr(gpt, "language_model", gpt)
    if getattr(gpt._postprocess, "__func__", None) is not _sharing_postprocess:
        gpt._stock_postprocess = gpt._postprocess  # or a patch applied since (verl's)
        gpt._postprocess = types.MethodType(_sharing_postprocess, gpt)
    gpt._mtp_detach_head = detach_head
    for layer in getattr(getattr(gpt, "mtp", None), "layers", ()):
        if type(layer) is MultiTokenPredictionLayer:
            layer.__class__ = PrefixSharingMTPLayer
        if isinstance(layer, PrefixSharingMTPLayer):
            layer.detach_encoder = detach_encoder
    return model


def serves_multi_token_prediction(gpt: torch.nn.Module) -> bool:
    """Whether ``gpt`` runs the postprocess of :func:`share_multi_token_prediction`."""
    return getattr(gpt._postprocess, "__func__", None) is _sharing_postprocess


def _sharing_postprocess(self: Any, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
    params = kwargs.get("packed_seq_params")
    if getattr(params, "plan", None) is None or not self.config.mtp_num_layers:
        return self._stock_postprocess(hidden_states=hidden_states, **kwargs)
    if params.mtp is None:  # planned without the depths: the MTP layers do not run
        kwargs["mtp_in_postprocess"] = False
    if kwargs.get("output_processor") is not None:
        raise ValueError("a sharing forward with multi-token prediction returns the logits "
                         "itself; it takes no output_processor")
    if kwargs.get("labels") is not None:
        raise ValueError("a sharing forward takes no labels (they differ between the sequences "
                         "that share a flat row): score the logits with token_stats")
    output_weight = self.shared_embedding_or_output_weight() if (
        self.share_embeddings_and_output_weights) else None
    if kwargs.get("mtp_in_postprocess"):
        hidden_states = self.mtp(
            input_ids=kwargs["input_ids"], position_ids=kwargs["position_ids"],
            hidden_states=hidden_states, attention_mask=kwargs.get("attention_mask"),
            rotary_pos_emb=kwargs.get("rotary_pos_emb"),
            rotary_pos_cos=kwargs.get("rotary_pos_cos"),
            rotary_pos_sin=kwargs.get("rotary_pos_sin"), packed_seq_params=params,
            sequence_len_offset=kwargs.get("sequence_len_offset"), embedding=self.embedding,
            **(kwargs.get("extra_block_kwargs") or {}))
    if not self.post_process:
        return hidden_states
    if params.mtp is not None:
        hidden_states = _attach_mtp_losses(self, hidden_states, params, output_weight,
                                           kwargs.get("runtime_gather_output"))
    logits, _ = self.output_layer(hidden_states, weight=output_weight,
                                  runtime_gather_output=kwargs.get("runtime_gather_output"))
    return logits.transpose(0, 1).contiguous()


def _attach_mtp_losses(gpt: Any, hidden_states: torch.Tensor, params: Any,
                       output_weight: torch.Tensor | None, runtime_gather_output: Any
                       ) -> torch.Tensor:
    """The decoder's rows of the block's output, each depth's loss attached (module doc).

    Under context parallelism each rank scores its own rows and one all-reduce completes every
    position's log-prob (:func:`.vocab_parallel.rows_token_stats`), so every rank holds
    the whole depth's loss and back-propagates it into its own rows. Megatron's schedule does
    not scale the MTP loss by the CP size (it does the main loss), while the gradients are
    averaged over the group: the loss is attached times the CP size, whose average is the
    whole micro-batch's gradient.
    """
    config = gpt.config
    if "forward" in vars(gpt.output_layer):  # lm_head_inputs: the head returns its input
        raise ValueError("the MTP depths are scored from the output layer's logits; run the "
                         "model without lm_head_inputs (score the decoder with token_stats)")
    depths = [mtp_depth(params, k) for k in range(1, config.mtp_num_layers + 1)]
    cp_size = 1 if params.cp is None else params.cp.size
    split = cp_size * (parallel_state.get_tensor_model_parallel_world_size()
                       if config.sequence_parallel else 1)
    sizes = [params.plan.num_tokens_flat // split] + [d.plan.num_tokens_flat // split
                                                     for d in depths]
    if hidden_states.size(0) != sum(sizes):
        raise ValueError(f"the MTP block returned {hidden_states.size(0)} rows; the depths' "
                         f"layouts hold {sum(sizes)}")
    decoder, *per_depth = torch.split(hidden_states, sizes, dim=0)
    if gpt._mtp_detach_head or getattr(config, "mtp_detach_heads", False):
        output_weight = (output_weight if output_weight is not None
                         else gpt.output_layer.weight).detach()
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    for k, (depth, hidden) in enumerate(zip(depths, per_depth)):
        logits, _ = gpt.output_layer(hidden, weight=output_weight,
                                     runtime_gather_output=runtime_gather_output)
        logits = logits.squeeze(1)  # [T_k (/ CP), V_local]
        log_probs = rows_token_stats(logits, depth.plan, depth.cp, with_entropy=False,
                                     vocab_shard=vocab_shard(logits.size(-1)),
                                     targets=depth.targets).log_probs
        loss = -(log_probs.float() * depth.weights).sum()
        num_tokens = depth.weights.sum().clamp(min=1)
        if gpt.training:
            _log_mtp_metrics(loss / num_tokens, logits, depth, k, config.mtp_num_layers)
        if not config.calculate_per_token_loss:
            attached = loss / num_tokens
        else:  # finalize_model_grads divides every gradient by the main loss's token count
            attached = loss * (depth.mask_tokens / num_tokens if _PER_TOKEN_LOSS_RESCALED else 1)
        decoder = MTPLossAutoScaler.apply(decoder, scale * cp_size * attached)
    return decoder


def _log_mtp_metrics(loss: torch.Tensor, logits: torch.Tensor, depth: MTPDepth, k: int,
                     depths: int) -> None:
    """Megatron's MTP logging of depth ``k``: its loss (and from megatron-core 0.19 the
    acceptance counts: positions whose most likely token is the label, of those weighed)."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if hasattr(MTPLossLoggingHelper, "save_loss_to_tracker"):
        MTPLossLoggingHelper.save_loss_to_tracker(loss.detach(), k, depths, avg_group=group)
        return
    with torch.no_grad():  # over this rank's rows' positions (under CP: summed over ranks)
        cp = depth.cp
        positions = (torch.arange(depth.targets.numel(), device=logits.device) if cp is None
                     else cp.token_positions)
        rows = depth.plan.kv_index.index_select(0, positions) - (0 if cp is None
                                                                  else cp.row_start)
        best = _vocab_parallel_argmax(logits).index_select(0, rows)
        weighed = depth.weights.index_select(0, positions) > 0
        correct = ((best == depth.targets.index_select(0, positions)) & weighed).sum().float()
        total = weighed.sum().float()
    MTPLossLoggingHelper.save_metrics_to_tracker(loss.detach(), correct, total, k, depths,
                                                 avg_group=group)


def _vocab_parallel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token id over the whole vocabulary (``[T, V_local]`` logits,
    split over the tensor-parallel group): the lowest id among equal maxima, as ``argmax``."""
    shard = vocab_shard(logits.size(-1))
    best, index = logits.max(dim=-1)
    if shard is None:
        return index
    index = index + shard.vocab_start
    top = shard.max(best)
    candidate = torch.where(best == top, index, torch.full_like(index, torch.iinfo(index.dtype).max))
    return -shard.max(-candidate)
