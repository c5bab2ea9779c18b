"""One shared forward of a HuggingFace causal LM: sequences -> plan -> model -> log-probs.

The model runs once on the plan's flat layout, a batch of one row
(``input_ids=plan.input_ids[None]``, ``position_ids=plan.position_ids[None]``), with the plan in
its keywords for the sharing attention (:mod:`.attention`). Per-token log-probs and entropy
come from the flat logits through :func:`prefix_sharing.logprobs.token_log_probs`, so nothing
of size ``(T_total, vocab)`` is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from ..config import PrefixSharingConfig
from ..logprobs import TokenStats, token_log_probs
from ..plan import SharingPlan
from ..planner import PromptGroup, build_plan
from ..refusals import refuse
from ..prefix_kv import PrefixKVStack
from .attention import (ATTENTION_NAME, BACKEND_KWARG, PLAN_KWARG, PREFIX_KV_KWARG,
                        register_attention)
from .gated_deltanet import check_sharing_gdn, install_sharing_gdn
from .mamba2 import check_sharing_mamba, install_sharing_mamba
from .models import check_supported
from .moe import router_aux_loss
from .mrope import vision_model_kwargs
from .response_rows import ResponseRows, response_rows
from .vision import VisionBatch, vision_batch
from .vlm import check_sharing_vision, install_sharing_vision, is_vlm, text_config

__all__ = ["enable_prefix_sharing", "SharedForward", "shared_forward", "model_kwargs"]


def enable_prefix_sharing(model: torch.nn.Module) -> torch.nn.Module:
    """Switches ``model`` (in place) to the sharing attention, and its Gated DeltaNet layers
    (Qwen3.5, Qwen3-Next) and Mamba-2 mixers (Nemotron-H) to the sharing recurrence; returns it.

    Call it before wrapping the model (FSDP, gradient checkpointing). From then on every
    forward needs a plan: use :func:`shared_forward`, or pass :func:`model_kwargs`.
    """
    check_supported(model)
    register_attention()
    # a VLM's vision tower keeps its own attention: only its language model reads the plan
    model.set_attn_implementation({"text_config": ATTENTION_NAME} if is_vlm(model)
                                  else ATTENTION_NAME)
    install_sharing_vision(model)
    install_sharing_gdn(model)
    install_sharing_mamba(model)
    return model


@dataclasses.dataclass
class SharedForward:
    """The result of :func:`shared_forward`.

    Attributes:
        plan: the micro-batch's plan (on the model's device).
        logits: ``(T_flat, vocab)`` logits of the computed tokens; ``plan.restore`` gives every
            sequence's ``(T_total, vocab)`` rows when a caller truly needs them. With
            ``response_starts``: ``(R, vocab)``, the rows of ``response.rows`` only.
        stats: ``(T_total,)`` log-probs and entropy, packed per sequence in the given order;
            with ``response_starts``, per sequence its response positions plus its last one
            (``response.split`` separates them).
        aux_loss: for an MoE model, the router load-balancing loss the plain forward would
            give (see :mod:`.moe`); ``None`` otherwise.
        response: the kept LM-head rows when ``response_starts`` was given, else ``None``.
        images: a VLM micro-batch's images (``images_total``, ``images_computed``: what the
            plain forward and this one encode), ``None`` without images.
    """

    plan: SharingPlan
    logits: torch.Tensor
    stats: TokenStats
    aux_loss: torch.Tensor | None
    response: ResponseRows | None = None
    images: VisionBatch | None = None

    def metrics(self, prefix: str = "prefix_sharing/") -> dict[str, float]:
        """The micro-batch's counts, to log: tokens of the plain forward and computed here,
        and for a VLM micro-batch with images its images and image tokens (see
        :meth:`~prefix_sharing.fsdp_compat.vision.VisionBatch.metrics`)."""
        out = {f"{prefix}tokens_total": float(self.plan.num_tokens_total),
               f"{prefix}tokens_computed": float(self.plan.num_tokens_unique)}
        if self.images is not None:
            out.update(self.images.metrics(self.plan, prefix))
        return out


def model_kwargs(plan: SharingPlan, backend: str = "auto",
                 prefix_kv: PrefixKVStack | None = None) -> dict:
    """The keywords a model switched by :func:`enable_prefix_sharing` needs for ``plan``.

    Besides the plan, the segment boundaries go in explicitly (``cu_seq_lens_q/k``,
    ``max_length_q/k``): transformers otherwise infers packed segments from position resets,
    and a reuser's tail starts at its prefix length, not at 0. ``prefix_kv``: what a
    micro-batch of a group run across micro-batches reads and records (its plan's external
    rows; :mod:`.cross_steps`), bound to this forward now (its stores' modes fixed).
    """
    if plan.external_rows and prefix_kv is None:
        raise ValueError(f"a plan with {plan.external_rows} external K/V rows needs the "
                         "prefix_kv it reads them from")
    kwargs = {
        "input_ids": plan.input_ids[None],
        "position_ids": plan.position_ids[None],
        "cu_seq_lens_q": plan.cu_seqlens_q,
        "cu_seq_lens_k": plan.cu_seqlens_kv,
        "max_length_q": plan.max_seqlen_q,
        "max_length_k": plan.max_seqlen_kv,
        "use_cache": False,
        PLAN_KWARG: plan,
        BACKEND_KWARG: backend,
    }
    if prefix_kv is not None:
        kwargs[PREFIX_KV_KWARG] = prefix_kv.forward_pass()
    return kwargs


def shared_forward(
    model: torch.nn.Module,
    sequences: Sequence[torch.Tensor],
    config: PrefixSharingConfig | None = None,
    *,
    groups: Sequence[PromptGroup] | None = None,
    plan: SharingPlan | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    response_starts: Sequence[int] | None = None,
    multi_modal_inputs: Sequence[Mapping | None] | None = None,
) -> SharedForward:
    """Plans ``sequences`` (unless ``plan`` is given) and runs ``model`` once on the plan.

    Args:
        model: a causal LM switched by :func:`enable_prefix_sharing` (FSDP-wrapped or not).
        sequences: the micro-batch, unpadded 1-D token-id tensors, in the order the outputs
            should have.
        config: what to share (``PrefixSharingConfig()`` when omitted); its ``backend`` picks
            the attention kernel.
        groups: prompt groups, for ``mode="prompt_only"``.
        plan: a plan already built for these sequences (e.g. once per micro-batch, reused
            across the actor and reference forwards).
        temperature, with_entropy: as in :func:`~prefix_sharing.logprobs.token_log_probs`.
        response_starts: per sequence, its first response token's index (its prompt length):
            then the LM head runs only on the rows that predict response tokens
            (:mod:`.response_rows`), and the stats cover those positions only.
        multi_modal_inputs: for a vision-language model (:mod:`.vlm`), per sequence its
            images in verl's per-sample layout (``{"pixel_values", "image_grid_thw"}``) or
            ``None``: images enter the tokens' identity (:mod:`.vision`), the encoder runs once
            per distinct image, positions are the model's mrope rows (:mod:`.mrope`). A given
            ``plan`` must have been built with ``images=vision_batch(...).tags``.
    """
    config = PrefixSharingConfig() if config is None else config
    if getattr(text_config(model.config), "_attn_implementation", None) != ATTENTION_NAME:
        raise ValueError("the model does not use the sharing attention: call "
                         "enable_prefix_sharing(model) first (before wrapping it)")
    check_sharing_gdn(model)
    check_sharing_mamba(model)
    images = None
    if is_vlm(model):
        images = vision_batch(model.config, sequences, multi_modal_inputs)
    elif multi_modal_inputs is not None and any(m for m in multi_modal_inputs):
        raise refuse("hf.images_for_text_model",
                     f"multi_modal_inputs were given for {type(model).__name__}")
    if plan is None:
        plan = build_plan(sequences, config, groups=groups,
                          images=None if images is None else images.tags)
    plan = plan.to(model.get_input_embeddings().weight.device)
    moe = _is_moe(model)
    extra = {"output_router_logits": True} if moe else {}
    response = None if response_starts is None else response_rows(plan, response_starts)
    if response is not None:
        extra["logits_to_keep"] = response.rows
    if images is not None:
        check_sharing_vision(model)
        extra.update(vision_model_kwargs(model, sequences, plan, images))
    output = model(**{**model_kwargs(plan, config.backend), **extra})
    logits = output.logits[0]  # [T_flat or R, vocab]
    layout = plan if response is None else response
    stats = token_log_probs(logits, layout, temperature=temperature, with_entropy=with_entropy)
    aux_loss = None
    if moe:
        text = text_config(model.config)
        aux_loss = router_aux_loss(output.router_logits, plan, text.num_experts,
                                   text.num_experts_per_tok)
    return SharedForward(plan, logits, stats, aux_loss, response, images)


def _is_moe(model: torch.nn.Module) -> bool:
    """A routed-experts model whose forward reports a load-balancing loss."""
    config = text_config(model.config)
    return hasattr(config, "router_aux_loss_coef") and hasattr(config, "num_experts")
