"""Patch sets ``verl091_fsdp`` and ``verl080_fsdp``: prefix sharing in verl's FSDP engine.

verl's FSDP language-model engine (``FSDPEngineWithLMHead``,
``verl/workers/engine/fsdp/transformer_impl.py``) runs each micro-batch as
``prepare_model_inputs`` -> ``self.module(**model_inputs, use_cache=False)`` ->
``prepare_model_outputs`` -> the loss, inside its ``forward_step``. With
``use_remove_padding`` it feeds the HuggingFace model one packed ``(1, total_nnz)`` row.

Hooks (each runs when verl imports the module):

- ``verl.workers.config.actor``: ``FSDPActorConfig`` accepts ``prefix_grouper`` and hands the
  validated config to its engine config, ``fsdp_config`` (:mod:`.config`);
  ``verl.workers.config.critic``: ``FSDPCriticConfig`` accepts ``use_prefix_grouper`` and
  ``prefix_grouper`` the same way (the critic, :mod:`.critic`); the unhooked engines' config classes too (and their engine
  configs, the SFT trainer's ``engine`` section, in ``verl.workers.config.engine``);
- ``verl.workers.engine.fsdp.transformer_impl``: the registered language-model engine becomes
  ``PrefixSharingFSDPEngine`` and the value-model engine ``PrefixSharingFSDPValueEngine`` (the
  same subclass over ``FSDPEngineWithValueHead``: values per token instead of log-probs;
  backends ``fsdp`` / ``fsdp2``, every device verl registered);
- the modules of verl's VeOmni, AutoModel and TorchTitan engines (when their packages let verl
  import them): their engines refuse sharing by name (:mod:`.unhooked`);
- ``verl.workers.engine.utils``: the dynamic-batch-size split keeps sharing groups together
  (:mod:`.microbatch`; the same hook as the Megatron sets, applied once).
- ``verl.trainer.ppo.ray_trainer`` / ``verl.trainer.ppo.v1.trainer_base``: the trainer's
  data-parallel balancing keeps sharing groups on one rank (:mod:`.balancing`).

``PrefixSharingFSDPEngine``, with sharing on (``__init__`` and ``forward_backward_batch`` are
:class:`.engine.SharingEngineMixin`'s, the same as in the Megatron engine):

- ``__init__`` refuses what cannot be exact (:func:`.mcore.check_engine_setup`: value models,
  multimodal models outside :data:`.vlm.ENGINE_FAMILIES`; under Ulysses sequence parallelism,
  the models it cannot split, :func:`.ulysses.ulysses_problems`, from the HF config: its
  ``setup_problems``, which ``preflight`` reads); ``use_fused_kernels`` is served
  (``serves_fused_kernels``);
- ``_build_module`` gives a vision-language model's instances transformers' own forwards back
  (:func:`.vlm.restore_stock_forwards`: verl's replace them class-wide), then switches the HF
  model to the sharing attention
  (:func:`prefix_sharing.fsdp_compat.enable_prefix_sharing`) after verl has loaded and
  monkey-patched it and before ``_build_fsdp_module`` wraps it. verl has turned gradient
  checkpointing on by then; that is harmless, as transformers reads the attention
  implementation from the config at every call and the checkpointed layer replays the same
  keywords, the plan included. verl's remove-padding patch replaces only the flash-attention
  function, which the sharing attention does not call. Then the model
  instance's forward and its LM head's are wrapped
  (:func:`prefix_sharing.fsdp_compat.head.install_hidden_state_head`) so that a forward with a
  head request returns log-probs and entropy computed from the last hidden states in chunks of
  rows (:mod:`prefix_sharing.head_logprobs`), never logits; a model whose final logits are
  soft-capped or scaled keeps its logits (unless ``use_fused_kernels``, whose verl kernel skips
  that transform too), and so does a MoE model with ``output_router_logits`` on
  (:func:`prefix_sharing.fsdp_compat.head.head_problem`);
- ``prepare_model_inputs`` plans the micro-batch from its nested ``input_ids`` (and ``uid`` for
  ``prompt_only``) - in either layout: with ``use_remove_padding=False`` verl hands the
  micro-batch over nested as well and pads it only for the model call, and its padded outputs
  follow the packed ones' jagged contract, so the padded layout is served as is - and
  returns :func:`prefix_sharing.fsdp_compat.model_kwargs` of the plan; for a VLM micro-batch
  with images, the plan takes the images' identity from its per-sample
  ``multi_modal_inputs`` and the inputs add the HF shim's mrope rows, distinct images and
  feature rows (:func:`prefix_sharing.fsdp_compat.mrope.vision_model_kwargs`), and the step's
  metrics count images and image tokens (:mod:`.vlm`); a VLM micro-batch without images
  encodes verl's blank image, none of whose features is placed (:func:`.vlm.blank_image_kwargs`).
  Under Ulysses the plan is padded to a multiple of the group size and each rank gets its rows
  and the split for the attention's all-to-all (:mod:`.ulysses`); otherwise, with the chunked
  head, the inputs carry the head request
  (:class:`prefix_sharing.fsdp_compat.head.HeadRequest`: the plan, the temperature,
  ``calculate_entropy`` and the read window, each sample from its prompt's last position when
  the micro-batch has ``responses``);
- ``prepare_model_outputs`` takes the head's log-probs / entropy (or, for a transformed head or
  under Ulysses, turns the flat logits into them through
  :func:`prefix_sharing.logprobs.token_log_probs`; under Ulysses each rank scores the positions
  of its rows and every rank gets them all,
  :func:`prefix_sharing.fsdp_compat.ulysses.ulysses_token_stats`) in verl's output contract:
  jagged nested tensors, one row per sample with its original length, the value at ``t``
  scoring token ``t + 1`` at verl's temperature. verl reads only ``[len - response - 1, len -
  1)``: the chunked head scores only those positions (and each sample's last one), the others
  are 0. The last position of each sample predicts nothing (verl reads a wrapped-around label
  there, this gives 0). verl's entropy switches (``entropy_from_logits_with_chunking``,
  ``entropy_checkpointing``, ``use_torch_compile``) change how verl computes the entropy of
  full logits, which the chunked head never builds: the results are the same;
- with ``prefix_grouper.self_check``, ``prepare_model_outputs`` of the first sharing
  micro-batch also runs verl's stock path on it (:mod:`.self_check`): verl's own
  ``prepare_model_inputs``, the model with the attention implementation it was loaded with
  (:func:`stock_attention`) and verl's own ``prepare_model_outputs``, inside verl's autocast.
  A model whose recurrent layers were switched (Gated DeltaNet, Mamba-2) is refused: its
  switched layers need a plan, and verl's packed row runs their stock forms as one sequence;
- ``forward_backward_batch`` runs verl's own inside :func:`.microbatch.sharing_split` and adds
  the step's token counts (:class:`.mcore.SharingMetrics`) and the split's figures to verl's
  metrics.

verl's ``forward_step`` (device move, autocast, the loss, detaching the outputs) runs as is.
With sharing off (``mode: off``, or the reference model without an overlay) every method is
verl's own. ``pad_to_length`` (a static packed length for compiled kernels) is not applied to
the flat layout: it changes no result.

Per release: 0.9.1 and 0.8.0 have the same seams (``FSDPActorConfig`` converting into
``fsdp_config``, ``_build_module``, ``prepare_model_inputs`` / ``prepare_model_outputs`` around
the model call in ``forward_step``, ``prepare_micro_batches`` in ``forward_backward_batch``), so
both sets apply the same hooks. What differs lies outside them: 0.9.1 adds bucketed
``pad_to_length``, deferred gradient sync across micro-batches and detached outputs; 0.8.0
runs on transformers 4.57, 0.9.1 on 5.x (the sharing attention is registered with either).
verl's own PrefixGrouper patch (``apply_monkey_patch(use_prefix_grouper=...)``) is called by
neither engine (its caller was the legacy ``dp_actor``), so ``use_prefix_grouper: true``
selects this sharing (``prompt_only`` unless ``prefix_grouper.mode`` says otherwise). verl
0.9.1's separate ``fsdp_turbo`` backend and the TorchTitan / AutoModel engines are
left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from types import ModuleType
from typing import Any

from ..refusals import Refused, refuse
from .balancing import balancing_hooks
from . import unhooked
from .config import config_hooks, sharing_config
from .critic import restore_values, value_head_problems
from .engine import SharingEngineMixin, install_engines
from .fsdp_cross import CrossLoop
from .microbatch import patch_prepare_micro_batches
from .patchsets import register_releases
from .switched_off import off_hooks
from .ulysses import has_recurrent_layers, plan_padding, sequence_parallel_group, ulysses_problems
from .vlm import (ENGINE_FAMILIES, blank_image_kwargs, micro_batch_images,
                  record_stock_forwards, restore_stock_forwards)

__all__ = ["PATCHSETS", "patch_engine", "stock_attention"]

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
# the config classes whose engines this set patches (the unhooked engines': to refuse, .unhooked)
ACTOR_CONFIGS = ("FSDPActorConfig", *unhooked.ACTOR_CONFIGS)
CRITIC_CONFIGS = ("FSDPCriticConfig", *unhooked.CRITIC_CONFIGS)
ENGINE_CONFIGS = ("FSDPEngineConfig", *unhooked.ENGINE_CONFIGS)


@contextlib.contextmanager
def stock_attention(hf_module: Any, implementation: str) -> Iterator[None]:
    """Within the block ``hf_module`` (switched by ``enable_prefix_sharing``) runs the attention
    ``implementation`` it was loaded with; transformers reads it from the config at every call."""
    from ..fsdp_compat.attention import ATTENTION_NAME

    hf_module.set_attn_implementation(implementation)
    try:
        yield
    finally:
        hf_module.set_attn_implementation(ATTENTION_NAME)


def patch_engine(module: ModuleType) -> None:
    """Hook on ``verl.workers.engine.fsdp.transformer_impl``: defines ``PrefixSharingFSDPEngine``
    there and registers it in place of verl's ``FSDPEngineWithLMHead``."""
    import torch
    from verl.utils import tensordict_utils as tu

    from ..fsdp_compat import enable_prefix_sharing, model_kwargs
    from ..fsdp_compat.head import (HEAD_KWARG, HeadOutput, HeadRequest, head_problem,
                                    install_hidden_state_head)
    from ..fsdp_compat.mrope import vision_model_kwargs
    from ..fsdp_compat.ulysses import ulysses_model_kwargs, ulysses_split, ulysses_token_stats
    from ..fsdp_compat.vision import vision_batch
    from ..fsdp_compat.vlm import is_vlm
    from ..logprobs import token_log_probs
    from ..planner import build_plan
    from .mcore import (PrefixSharingSetupError, micro_batch_groups, micro_batch_temperature,
                        prompt_lengths)

    record_stock_forwards()  # before any engine's apply_monkey_patch replaces them

    def sharing_engine(stock: type, value_head: bool) -> type:
        """The sharing subclass of ``stock`` (verl's language-model engine, or its value-model
        engine with ``value_head``: the critic)."""

        class PrefixSharingFSDPEngine(SharingEngineMixin, CrossLoop, stock):
            """verl's ``FSDPEngineWithLMHead`` (or ``FSDPEngineWithValueHead``), computing each
            micro-batch's shared prefixes once."""

            vision_families = ENGINE_FAMILIES
            serves_fused_kernels = True  # the sharing head is chunked from the hidden states
            value_head = False  # the critic's engine: values per token instead of log-probs

            @classmethod
            def setup_problems(cls, model_config, engine_config) -> list:
                """The common refusals; the critic's (:func:`.critic.value_head_problems`);
                under Ulysses the models it cannot split (:func:`.ulysses.ulysses_problems`,
                from the HF config); and a vision-language model's groups across
                micro-batches (a block's forward takes no images: :mod:`.fsdp_cross`)."""
                found = super().setup_problems(model_config, engine_config)
                sharing = sharing_config(engine_config)
                hf_config = getattr(model_config, "hf_config", None)
                if sharing.enabled:
                    if cls.value_head:
                        found += value_head_problems(engine_config)
                    found += ulysses_problems(
                        hf_config, getattr(engine_config, "ulysses_sequence_parallel_size", 1))
                    if sharing.cross_micro_batch and is_vlm(hf_config):
                        found.append(Refused("verl.multimodal", "prefix_grouper."
                                             "cross_micro_batch=true with a vision-language "
                                             "model"))
                return found

            keeps_cross_prefix = False  # every block is computed again: .fsdp_cross

            def cross_row_multiple(self) -> int:
                """A cross group's plans are padded to the Ulysses group's size, as every
                plan of this engine is (:func:`.ulysses.plan_padding`)."""
                return plan_padding(self)

            def _build_module(self):
                hf_module = super()._build_module()
                if self.prefix_sharing.enabled:
                    self._stock_attention = (hf_module, hf_module.config._attn_implementation)
                    if is_vlm(hf_module):
                        if self.prefix_sharing.self_check:
                            raise refuse("verl.self_check.vlm", "prefix_grouper.self_check=true",
                                         error=PrefixSharingSetupError)
                        restore_stock_forwards(hf_module)  # transformers' own, for the plan
                    enable_prefix_sharing(hf_module)  # before _build_fsdp_module wraps it
                    # log-probs from the hidden states in chunks of rows, unless the head is not a
                    # plain linear layer (then from the model's logits, token_log_probs); verl's
                    # fused kernels skip a final logit transform, so the head does too under them
                    fused = bool(getattr(self.model_config, "use_fused_kernels", False))
                    self._hidden_head = not self.value_head and head_problem(
                        hf_module, ignore_logit_transform=fused) is None
                    if self._hidden_head:
                        install_hidden_state_head(hf_module, ignore_logit_transform=fused)
                    if self.prefix_sharing.self_check and has_recurrent_layers(hf_module):
                        raise refuse("verl.self_check.recurrent", "prefix_grouper.self_check=true",
                                     error=PrefixSharingSetupError)
                return hf_module

            def _stock_outputs(self, micro_batch, logits_processor_func):
                """verl's own forward of ``micro_batch`` (the self-check's reference)."""
                with stock_attention(*self._stock_attention):
                    model_inputs, output_args = stock.prepare_model_inputs(self, micro_batch)
                    output = self.module(**model_inputs, use_cache=False)
                    return stock.prepare_model_outputs(self, output, output_args, micro_batch,
                                                       logits_processor_func)

            def prepare_model_inputs(self, micro_batch):
                if not self.prefix_sharing.enabled:
                    return super().prepare_model_inputs(micro_batch)
                part = (self.cross_part(micro_batch) if self.prefix_sharing.cross_micro_batch
                        else None)
                if part is not None:  # a cross group's micro-batch (.fsdp_cross)
                    self.refuse_unsupported_switches(micro_batch)
                    model_inputs, output_args = self.cross_inputs(
                        micro_batch, part, micro_batch["input_ids"].device)
                    readout = output_args["readout"]
                    if self._hidden_head and "ulysses" not in output_args:  # tails' log-probs
                        model_inputs[HEAD_KWARG] = HeadRequest(
                            output_args["tail_plan"], readout.temperature,
                            with_entropy=readout.with_entropy)
                    return model_inputs, output_args
                unsupported = []
                vlm = is_vlm(self.module)
                if not vlm and module.extract_multi_modal_inputs(
                        micro_batch.get("multi_modal_inputs", [])):  # as verl reads them
                    unsupported.append(Refused("verl.multimodal", "multi_modal_inputs"))

                self.refuse_unsupported_switches(micro_batch, *unsupported)
                input_ids = micro_batch["input_ids"]  # jagged nested (bsz, j1)
                sequences = list(input_ids.unbind())
                groups = None
                if self.prefix_sharing.mode == "prompt_only":
                    groups = micro_batch_groups(micro_batch, len(sequences))
                images = None
                if vlm:  # None for a text-only micro-batch
                    images = vision_batch(self.module.config, sequences,
                                          micro_batch_images(micro_batch, len(sequences)))
                plan = build_plan(sequences, self.prefix_sharing, groups=groups,
                                  images=None if images is None else images.tags,
                                  pad_to_multiple_of=plan_padding(self))  # as verl pads for Ulysses
                plan = plan.to(input_ids.device)
                self._sharing_metrics.add(plan)
                model_inputs = model_kwargs(plan, self.prefix_sharing.backend)
                del model_inputs["use_cache"]  # verl's forward_step passes use_cache=False itself
                if images is not None:  # mrope rows, distinct images, feature rows
                    model_inputs.update(vision_model_kwargs(self.module, sequences, plan, images))
                    self._sharing_metrics.add_vision(images.metrics(plan))
                elif vlm:  # a text-only micro-batch: the tower runs on a blank image, as in verl's
                    model_inputs.update(blank_image_kwargs(self.module, input_ids.device))
                output_args = {"plan": plan,
                               "temperature": micro_batch_temperature(micro_batch["temperature"])}
                group = sequence_parallel_group(self)
                if group is not None:  # this rank's rows; the split for the attention and log-probs
                    output_args["ulysses"] = ulysses_split(plan, group)
                    model_inputs.update(ulysses_model_kwargs(plan, output_args["ulysses"]))
                elif self._hidden_head:  # the model returns log-probs / entropy, no logits
                    model_inputs[HEAD_KWARG] = HeadRequest(
                        plan, output_args["temperature"],
                        with_entropy=tu.get_non_tensor_data(micro_batch, key="calculate_entropy",
                                                            default=False),
                        read_from=read_from(micro_batch))
                return model_inputs, output_args

            def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
                if not self.prefix_sharing.enabled:
                    return super().prepare_model_outputs(output, output_args, micro_batch,
                                                          logits_processor_func)
                if "cross" in output_args:  # its tails' outputs after its blocks'
                    return self.cross_outputs(output, output_args, None if self.value_head else
                                              cross_tail_stats(output, output_args))
                if self.value_head:  # a value per token: the flat row that computed it
                    return {"values": restore_values(self.model_rows(output),
                                                     output_args["plan"])}
                calculate_entropy = tu.get_non_tensor_data(micro_batch, key="calculate_entropy",
                                                           default=False)
                stats = output_stats(output, output_args["plan"], output_args.get("ulysses"),
                                     output_args["temperature"], calculate_entropy)
                offsets = micro_batch["input_ids"].offsets()  # the plan packs samples in this order
                model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(stats.log_probs,
                                                                                     offsets)}
                if calculate_entropy:
                    model_output["entropy"] = torch.nested.nested_tensor_from_jagged(stats.entropy,
                                                                                     offsets)
                self._self_check.check(
                    output_args["plan"], model_output,
                    lambda: self._stock_outputs(micro_batch, logits_processor_func),
                    getattr(self, "_autocast_dtype", torch.bfloat16),  # verl's compute dtype
                    read_from(micro_batch) if isinstance(output, HeadOutput) else None)
                return model_output

        PrefixSharingFSDPEngine.value_head = value_head
        return PrefixSharingFSDPEngine


    def output_stats(output, plan, split, temperature: float, with_entropy: bool):
        """Log-probs and entropy over ``plan`` of a forward's ``output``: the sharing head's,
        or from its ``[T_flat (/ Ulysses), vocab]`` logits (each rank scoring its rows under
        the Ulysses ``split``)."""
        if isinstance(output, HeadOutput):
            return output.stats
        score = token_log_probs if split is None else partial(ulysses_token_stats, split=split)
        return score(output.logits[0], plan, temperature=temperature, with_entropy=with_entropy)

    def cross_tail_stats(output, output_args) -> tuple:
        """A cross micro-batch's log-probs and entropy at its tails (its tail plan's packed
        order)."""
        readout = output_args["readout"]
        stats = output_stats(output, output_args["tail_plan"], output_args.get("ulysses"),
                             readout.temperature, readout.with_entropy)
        return stats.log_probs, stats.entropy

    def read_from(micro_batch) -> list[int] | None:
        """Per sample, the first position verl reads: its prompt's last one (``[len - response
        - 1, len - 1)`` is read) when the micro-batch has responses (RL); ``None`` (every
        position) without them (SFT's loss reads the whole sample through its loss mask)."""
        if micro_batch.get("responses", None) is None:
            return None
        return [n - 1 for n in prompt_lengths(micro_batch)]

    install_engines(module, sharing_engine, (
        ("FSDPEngineWithLMHead", "PrefixSharingFSDPEngine", False),
        ("FSDPEngineWithValueHead", "PrefixSharingFSDPValueEngine", True)))


PATCHSETS = register_releases(
    "fsdp",
    hooks={
        **config_hooks(ACTOR_CONFIGS, CRITIC_CONFIGS, ENGINE_CONFIGS),
        ENGINE_MODULE: patch_engine,
        **unhooked.engine_hooks(),
        "verl.workers.engine.utils": patch_prepare_micro_batches,
        **balancing_hooks(),
    },
    summary="verl {release} FSDP engine: actor config, sharing attention, forward, "
            "group-keeping micro-batches, metrics",
    off_hooks=off_hooks(ACTOR_CONFIGS, CRITIC_CONFIGS, ENGINE_CONFIGS),
)
