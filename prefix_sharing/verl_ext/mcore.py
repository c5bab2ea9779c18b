"""verl's Megatron engine forward, with each micro-batch's shared prefixes computed once.

Version-neutral pieces that a verl patch set wires into its release's engine:

- :func:`check_engine_setup`: the engine settings sharing cannot honour raise one clear error;
- :func:`shared_forward`: a drop-in for verl's ``gptmodel_forward_model_engine`` (same
  arguments) that plans the micro-batch from its token ids, runs the model on the flat layout
  and returns log-probs / entropy in verl's output contract: a dict of jagged nested tensors,
  one row per sample with its original length, in micro-batch order, the value at ``t`` scoring
  token ``t + 1`` (verl's label roll). The last position of each sample predicts nothing: verl
  fills it from a wrapped-around label, here it is 0; verl reads only
  ``[len - response - 1, len - 1)``.
- :func:`micro_batch_groups`: verl's ``uid`` and prompt lengths (:func:`prompt_lengths`) as
  prompt groups (``mode="prompt_only"``);
- :class:`SharingMetrics`: per-step token counts, reported through verl's metrics dict.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch

from ..config import PrefixSharingConfig
from ..errors import PrefixSharingSetupError
from ..planner import PromptGroup, prompt_groups
from ..refusals import Refused, refuse, refuse_all
from .critic import restore_values
from .mcore_mtp import mtp_plan_arguments, trains_mtp
from .routing_replay import (RouteRecorder, check_padded_statistics, replay_mode_problems,
                             router_action)
from .self_check import FirstStepSelfCheck
from .vlm import UNSERVED_FAMILIES

__all__ = [
    "PrefixSharingSetupError",
    "SharingMetrics",
    "check_engine_setup",
    "last_chunk_of_rank",
    "micro_batch_groups",
    "micro_batch_temperature",
    "prompt_lengths",
    "shared_forward",
    "shared_fused_forward",
    "fused_forward_patched",
    "fused_kernel_problems",
]


def check_engine_setup(engine_config: Any, model_config: Any | None = None, *,
                       vision_families: tuple[str, ...] = (),
                       serves_fused_kernels: bool = False, serves_mtp: bool = False) -> None:
    """Raises :class:`PrefixSharingSetupError` for settings that sharing cannot honour, in
    either verl engine (Megatron or FSDP: each reads the settings it has; ``vision_families``:
    the vision-language model types the engine serves, :mod:`.vlm`; ``serves_fused_kernels``:
    the engine computes ``use_fused_kernels``' log-probs itself, as the FSDP engine does;
    ``serves_mtp``: the engine trains MTP layers, as the Megatron engine does, :mod:`.mcore_mtp`).

    - dynamic CP (Megatron: ``dynamic_context_parallel``, a per-micro-batch CP group built on
      megatron's dynamic DPxCP groups, which no megatron-core release has: it cannot run, so
      it cannot be tested with sharing). Static ``context_parallel_size > 1`` runs: the plan splits the flat layout over the CP ranks and
      the core attention gathers K/V (:mod:`prefix_sharing.megatron_ext.context_parallel`); so
      does the FSDP engine's Ulysses (``ulysses_sequence_parallel_size > 1``, :mod:`.ulysses`,
      whose ``setup_problems`` refuses the models it cannot split, from their HF config);
    - ``use_fused_kernels=True`` unless ``serves_fused_kernels`` (verl's fused kernel computes
      log-probs from labels laid out per sample, which a shared row cannot give, one row
      serving several next tokens; both engines' sharing heads are chunked from the hidden
      states instead, :mod:`prefix_sharing.head_logprobs`; the Megatron engine's limits:
      :func:`fused_kernel_problems`);
    - MTP training (``model.mtp.enable_train``) unless ``serves_mtp``;
    - a model type other than verl's language and value models; a multimodal model outside ``vision_families`` (``verl.multimodal``), or
      one of them on a transformers older than the shim needs (``hf.vlm_release``: verl
      0.8.0's 4.57);
    - ``router_replay`` with ``context_parallel_size > 1`` (Megatron; :mod:`.routing_replay`):
      ``R2`` and ``R3`` are accepted otherwise.
    """
    found = []
    if getattr(engine_config, "dynamic_context_parallel", False):
        found.append(Refused("verl.dynamic_context_parallel", "dynamic_context_parallel=True"))
    if not serves_fused_kernels and any(getattr(c, "use_fused_kernels", False)
                                        for c in (engine_config, model_config)):
        found.append(Refused("verl.fused_kernels", "use_fused_kernels=True"))
    if not serves_mtp and trains_mtp(model_config):
        found.append(Refused("verl.mtp", "model.mtp.enable_train=True"))
    model_type = getattr(model_config, "model_type", "language_model")
    if model_type not in ("language_model", "value_model"):  # the actor's and the critic's
        found.append(Refused("verl.model_type", f"model_type={model_type!r}"))
    hf_config = getattr(model_config, "hf_config", None)
    if getattr(hf_config, "vision_config", None) is not None:
        found += _vision_problems(hf_config.model_type, vision_families)
    found += replay_mode_problems(engine_config)
    if found:
        raise refuse_all(found, error=PrefixSharingSetupError,
                         advice="Change the setting, or turn sharing off (use_prefix_grouper: "
                                "false).")



def last_chunk_of_rank(model: torch.nn.Module) -> bool:
    """Whether ``model`` is this rank's last model chunk: under interleaved pipeline stages
    each of a rank's chunks runs every micro-batch, and a micro-batch is counted once."""
    from megatron.core import parallel_state

    chunks = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    stage = getattr(model, "vp_stage", None)
    return chunks is None or stage is None or stage == chunks - 1


def virtual_pipeline_problems(engine_config: Any) -> list[Refused]:
    """Interleaved pipeline stages are served; verl builds them with ``overlap_p2p_comm=True``
    and ``batch_p2p_comm=False``, and only an ``override_transformer_config`` that turns the
    overlap off at PP=2 meets the refusal of :mod:`..megatron_ext.checks`
    (``megatron.virtual_pipeline.two_stage_p2p``): said from the engine config already, so
    that construction and ``preflight`` say it before a model is built."""
    stages = getattr(engine_config, "virtual_pipeline_model_parallel_size", None)
    pipeline = getattr(engine_config, "pipeline_model_parallel_size", 1)
    overrides = getattr(engine_config, "override_transformer_config", None) or {}
    if stages is not None and stages > 1 and pipeline == 2 and not overrides.get(
            "overlap_p2p_comm", True):
        return [Refused("megatron.virtual_pipeline.two_stage_p2p",
                        f"virtual_pipeline_model_parallel_size={stages} at "
                        "pipeline_model_parallel_size=2 with override_transformer_config."
                        "overlap_p2p_comm=False")]
    return []


def fused_kernel_problems(engine_config: Any, model_config: Any,
                          sharing: PrefixSharingConfig) -> list[Refused]:
    """Where the Megatron engine does not serve ``use_fused_kernels`` with sharing on: its head
    scores the whole flat layout on every tensor-parallel rank (:func:`shared_fused_forward`),
    so not under context parallelism, where each rank holds a slice of the rows, nor across
    micro-batches, whose forward scores from logits."""
    if not any(getattr(c, "use_fused_kernels", False) for c in (engine_config, model_config)):
        return []
    found = []
    cp = getattr(engine_config, "context_parallel_size", 1)
    if cp > 1:
        found.append(Refused("verl.fused_kernels",
                             f"use_fused_kernels=True with context_parallel_size={cp}"))
    if sharing.cross_micro_batch:
        found.append(Refused("verl.fused_kernels", "use_fused_kernels=True with "
                                                   "prefix_grouper.cross_micro_batch=true"))
    return found


def _vision_problems(model_type: str, vision_families: tuple[str, ...]) -> list[Refused]:
    """Why a model with a vision tower cannot run in the engine (nothing when it can)."""
    if model_type not in vision_families:
        reason = UNSERVED_FAMILIES.get(model_type)
        return [Refused("verl.multimodal", f"the model ({model_type}) has a vision_config"
                        + (f": {reason}" if reason else ""))]
    from ..fsdp_compat.vlm import vlm_release_problem

    problem = vlm_release_problem(model_type)
    return [Refused("hf.vlm_release", problem)] if problem else []


def prompt_lengths(batch: Any) -> list[int]:
    """Each sample's prompt length in a verl batch (whole or one micro-batch), read from what
    each of verl's trainers hands its engines:

    - the v1 trainer (verl 0.9's default, batch in TransferQueue) gives each sample's fields
      as stored, packed into jagged nested tensors: ``prompts`` is each sample's prompt, so
      its length is the answer (the nested ``attention_mask`` there is all ones);
    - the legacy trainer (verl 0.8.0, 0.9's ``use_v1: false``) converts its padded batch with
      ``left_right_2_no_padding``, which keeps the padded ``(bsz, prompt + response)``
      ``attention_mask`` beside the left-padded ``prompts`` (or, without them, the right-padded
      ``response_mask``): the prompt is the mask's left part.
    """
    prompts = batch.get("prompts", None)
    if prompts is not None and prompts.is_nested:
        return prompts.offsets().diff().tolist()
    attention_mask = batch.get("attention_mask", None)
    if attention_mask is not None and not attention_mask.is_nested:
        response_mask = batch.get("response_mask", None)
        if prompts is not None:
            return attention_mask[:, : prompts.size(1)].sum(-1).tolist()
        if response_mask is not None and not response_mask.is_nested:
            prompt_width = attention_mask.size(1) - response_mask.size(1)
            return attention_mask[:, :prompt_width].sum(-1).tolist()
    raise refuse("verl.prompt_lengths", "prefix_grouper.mode=prompt_only",
                 error=PrefixSharingSetupError)


def micro_batch_groups(batch: Any, num_sequences: int) -> list[PromptGroup]:
    """Prompt groups of a verl micro-batch: samples with the same ``uid`` share their prompt
    (:func:`prompt_lengths`)."""
    from verl.utils import tensordict_utils as tu

    uids = tu.get(batch, "uid")  # a plain list (get_non_tensor_data keeps NonTensorData items)
    if uids is None:
        raise refuse("verl.prompt_uids", "prefix_grouper.mode=prompt_only, no uid in the batch",
                     error=PrefixSharingSetupError)
    uids = list(uids)
    if len(uids) != num_sequences:
        raise ValueError(f"{len(uids)} uids for a micro-batch of {num_sequences} samples")
    return prompt_groups(uids, prompt_lengths(batch))


@dataclasses.dataclass
class SharingMetrics:
    """Tokens of the step: as packed (``total``) and as computed after sharing (``computed``);
    under routing replay, the tokens computed again because routes differ inside
    token-identical prefixes (``route_divergent``, None without replayed routes)."""

    total: int = 0
    computed: int = 0
    micro_batches: int = 0
    route_divergent: int | None = None
    vision: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, plan, replayed: bool = False) -> None:
        self.add_tokens(plan.num_tokens_total, plan.num_tokens_flat)
        if replayed:
            self.route_divergent = (self.route_divergent or 0) + plan.route_divergent_prefix_tokens

    def add_tokens(self, total: int, computed: int) -> None:
        """One micro-batch: its samples' tokens and the tokens its model run computed."""
        self.total += total
        self.computed += computed
        self.micro_batches += 1

    def add_vision(self, counts: dict[str, float]) -> None:
        """One VLM micro-batch's images and image tokens (``VisionBatch.metrics``), summed."""
        for key, value in counts.items():
            self.vision[key] = self.vision.get(key, 0.0) + value

    def as_verl_metrics(self) -> dict[str, list[float]]:
        """``prefix_sharing/token_ratio`` = total / computed tokens, as ``SharingPlan.token_ratio``
        and the batch split report it (1.0 when nothing is shared), and both counts.

        One value per step, as a one-element list like verl's per-micro-batch metrics: verl's
        worker all-gathers each metric over data-parallel ranks and then flattens the lists
        (``chain.from_iterable``), which a bare number fails."""
        metrics = {
            "prefix_sharing/token_ratio": [self.total / max(self.computed, 1)],
            "prefix_sharing/tokens_total": [float(self.total)],
            "prefix_sharing/tokens_computed": [float(self.computed)],
        }
        if self.route_divergent is not None:
            metrics["prefix_sharing/route_divergent_prefix_tokens"] = [float(self.route_divergent)]
        metrics.update({key: [value] for key, value in self.vision.items()})
        return metrics


def shared_forward(
    model,
    input_ids: torch.Tensor,
    multi_modal_inputs: dict,
    logits_processor=None,
    logits_processor_args: dict | None = None,
    value_model: bool = False,
    vision_model: bool = False,
    *,
    sharing: PrefixSharingConfig,
    groups: list[PromptGroup] | None,
    calculate_entropy: bool,
    metrics: SharingMetrics | None = None,
    replay_routes: list[torch.Tensor] | None = None,
    route_recorder: RouteRecorder | None = None,
    self_check: FirstStepSelfCheck | None = None,
    stock_forward: Callable[..., Any] | None = None,
    lm_head: str = "logits",
    mtp_enable_train: bool = False,
    **_verl_kwargs: Any,
) -> Any:
    """verl's ``gptmodel_forward_model_engine`` for one micro-batch, computing shared prefixes once.

    Arguments as verl passes them (``input_ids``: jagged nested ``(bsz, j1)``), plus the
    sharing config, the micro-batch's prompt groups (``prompt_only``), whether to return the
    entropy, where to count tokens, and the micro-batch's routes for ``router_replay``
    (:func:`.routing_replay.micro_batch_routes`: they shape the plan whenever given), replayed
    when verl has set the routers to replay, and where an ``R2`` recording goes when verl has
    set them to record (``route_recorder``). verl's own ``logits_processor`` is not called: its
    labels are laid out per sample, the flat layout has one row per computed token. With
    ``self_check`` pending, ``stock_forward`` (verl's own forward function) runs the same
    arguments as the reference (:mod:`.self_check`; the model's core attention takes the
    plain THD path for verl's packed layout). ``lm_head="hidden"`` (verl's
    ``use_fused_kernels``, :func:`shared_fused_forward`): the model returns its last hidden
    states and the head runs in chunks of rows inside the scoring, on this rank's vocabulary
    slice (:func:`prefix_sharing.megatron_ext.head_token_stats`); ``"logits"``: the model's
    vocab-parallel logits. verl's ``data_format`` (``"bshd"`` under
    ``use_remove_padding=False``) and its padding keywords go unused: the micro-batch arrives
    nested either way, the plan's flat layout replaces both of verl's, and verl's ``bshd``
    post-processing returns the same per-sample nested outputs as its ``thd`` one. A model
    with MTP layers plans its depths with verl's loss mask when verl trains them
    (``mtp_enable_train``, :mod:`.mcore_mtp`) and does not run them otherwise, as verl's
    forward without labels.

    Under context parallelism verl's ``local_cp_size`` / ``cp_layout`` (its zigzag split and
    the all-gather of its post-processing) are not used: each CP rank computes the log-probs
    and entropy of the positions its rows serve, and one all-reduce over the CP group completes
    them (:func:`prefix_sharing.megatron_ext.token_stats`), so every rank returns every sample
    whole, as verl's post-processing does. The gradient flows back into the local rows only;
    megatron's schedule scales the loss by the CP size and its ``finalize_model_grads``
    averages gradients over data x context parallel, which sums the CP ranks' shares.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    from ..megatron_ext import (check_sharing_model, head_token_stats, lm_head_inputs,
                                prepare_micro_batch, token_stats)

    check_text_only(vision_model, multi_modal_inputs)
    check_sharing_model(model)
    sequences = list(input_ids.unbind())
    action = router_action(unwrap_model(model))
    # the routes shape the plan wherever they come with the micro-batch, so a pipeline stage
    # without MoE layers (whose chunk shows no action) lays it out as the replaying stages do
    replays = replay_routes is not None and action in ("replay_forward", "replay_backward")
    records = route_recorder is not None and action == "record"
    if replays:
        check_padded_statistics(unwrap_model(model))
    # the plan's flat layout replaces verl's per-sample CP padding and zigzag split: padded to
    # CP x TP, each CP rank runs its contiguous slice of rows (then sequence parallel splits it)
    mb = prepare_micro_batch(
        sequences, sharing, groups=groups,
        pad_to_multiple_of=(parallel_state.get_tensor_model_parallel_world_size()
                            * parallel_state.get_context_parallel_world_size()),
        device=input_ids.device, routes=replay_routes, replay_routes=replays,
        record_routes=records,
        **mtp_plan_arguments(model, mtp_enable_train, logits_processor_args,
                             [len(s) for s in sequences]),
    )
    if metrics is not None and last_chunk_of_rank(unwrap_model(model)):
        metrics.add(mb.plan, replayed=replay_routes is not None)
    last_stage = unwrap_model(model).post_process
    capture = lm_head_inputs(model) if last_stage and lm_head == "hidden" else nullcontext()
    with capture as head:
        output = model(input_ids=mb.input_ids, attention_mask=None, position_ids=mb.position_ids,
                       packed_seq_params=mb.packed_seq_params)
    if route_recorder is not None:
        route_recorder.ran(unwrap_model(model), mb.plan)
    if not last_stage:
        return output  # an inner pipeline stage: activations for the next one
    if value_model:  # the critic: (1, T_flat, 1) values, one per flat row
        return restore_values(output[0, :, 0], mb.plan)
    temperature = micro_batch_temperature((logits_processor_args or {}).get("temperature"))
    if lm_head == "hidden":
        stats = head_token_stats(output, head, mb, temperature=temperature,
                                 with_entropy=calculate_entropy)
    else:
        stats = token_stats(output, mb, temperature=temperature,
                            with_entropy=calculate_entropy)
    result = {"log_probs": stats.log_probs}
    if calculate_entropy:
        result["entropy"] = stats.entropy
    result = {key: torch.nested.as_nested_tensor(mb.plan.split(value), layout=torch.jagged)
              for key, value in result.items()}
    if self_check is not None:
        self_check.check(mb.plan, result, lambda: stock_forward(
            model, input_ids, multi_modal_inputs, logits_processor, logits_processor_args,
            value_model, vision_model, **_verl_kwargs), unwrap_model(model).config.params_dtype)
    return result


def shared_fused_forward(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    multi_modal_inputs: dict,
    temperature: float,
    calculate_entropy: bool,
    pad_token_id: int,
    *,
    stock_forward: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> Any:
    """verl's fused forward (``use_fused_kernels``: ``fused_forward_model_engine``) for one
    micro-batch, computing shared prefixes once: :func:`shared_forward` with the head run in
    chunks from the hidden states (``lm_head="hidden"``), as verl's fused kernel does from its
    own. verl's ``labels`` (its per-sample rolled ``input_ids``) go unused: each position's
    target is its next token in the plan. ``kwargs``: :func:`shared_forward`'s sharing keywords
    and verl's remaining ones (CP layout, padding buckets), unused as there. With the
    self-check pending, ``stock_forward`` (verl's fused forward) is the reference, run with
    verl's fused patch on the model (:func:`fused_forward_patched`)."""
    reference = None
    if stock_forward is not None:
        def reference(*_shared_forward_arguments: Any, **_keywords: Any) -> Any:
            with fused_forward_patched(model):
                return stock_forward(model, input_ids, labels, multi_modal_inputs, temperature,
                                     calculate_entropy, pad_token_id)
    return shared_forward(model, input_ids, multi_modal_inputs,
                          logits_processor_args={"temperature": temperature},
                          calculate_entropy=calculate_entropy, stock_forward=reference,
                          lm_head="hidden", **kwargs)


@contextlib.contextmanager
def fused_forward_patched(model) -> Iterator[None]:
    """verl's fused-forward patch on ``model`` for the block (the sharing engine takes it off
    at build: :func:`shared_fused_forward` calls the model unpatched)."""
    from verl.models.mcore.model_forward_fused import patch_fused_forward, unpatch_fused_forward

    patch_fused_forward(model)
    try:
        yield
    finally:
        unpatch_fused_forward(model)


def check_text_only(vision_model: Any, multi_modal_inputs: Any) -> None:
    """Refuses vision inputs: sharing covers text-only models here (a vision model:
    :mod:`.mcore_vlm`, which the engine's construction already raised)."""
    found = [Refused("verl.multimodal", "multi_modal_inputs")] if multi_modal_inputs else []
    if vision_model:
        found.append(Refused("verl.megatron_vlm", "vision_model"))
    if found:
        raise refuse_all(found, error=PrefixSharingSetupError)


def micro_batch_temperature(temperature: Any) -> float:
    """The micro-batch's sampling temperature (verl's per-sample tensor, nested or not, a
    number, or ``None`` for 1): a shared row serves several samples, so they must all have the
    same one. Non-positive values become 1e-8, as verl clamps them."""
    if temperature is None:
        return 1.0
    if isinstance(temperature, torch.Tensor):
        values = temperature.values() if temperature.is_nested else temperature.reshape(-1)
        values = values.float().unique()
        if values.numel() != 1:
            raise refuse("verl.temperatures", f"temperatures {values.tolist()}",
                         error=PrefixSharingSetupError)

        temperature = values[0]
    value = float(temperature)
    return value if value > 0 else 1e-8
