"""Patch sets ``verl091_mcore`` and ``verl080_mcore``: prefix sharing in verl's Megatron engine.

Both releases have the same seams, so both sets apply the same hooks (each runs when verl
imports its module):

- ``verl.workers.config.actor``: ``McoreActorConfig`` accepts ``prefix_grouper`` and hands the
  validated config to its engine config (:mod:`.config`);
- ``verl.models.mcore`` (:func:`patch_forward_fn_lookup`): ``get_mcore_engine_forward_fn``
  returns :func:`.mcore.shared_forward` while a sharing engine runs a micro-batch
  (:func:`current_micro_batch`), or :func:`.cross_schedule.cross_forward` for a micro-batch of a
  group run across micro-batches (``prefix_grouper.cross_micro_batch``), verl's own forward
  otherwise. verl looks the function up at
  call time, inside ``forward_step``, which is what makes a per-micro-batch swap possible;
  while ``prefix_grouper.self_check`` is pending it also hands :func:`.mcore.shared_forward`
  verl's own forward function, the self-check's reference (:mod:`.self_check`; a micro-batch
  of a group run across micro-batches is not checked);
- ``verl.workers.engine.megatron.transformer_impl`` (:func:`patch_engine`): the registered
  language-model engine becomes ``PrefixSharingMegatronEngine`` for every device it was
  registered for. That subclass builds its model with the prefix-sharing layer spec
  (:func:`install_layer_spec`), reads each micro-batch (with its ``uid``) in ``forward_step``,
  splits dynamic batches keeping sharing groups together and reports the step's token counts in
  verl's metrics (:class:`.engine.SharingEngineMixin`); a vision-language model
  (:mod:`.mcore_vlm`), a Gated DeltaNet hybrid on a megatron-core other than 0.19.2
  (:mod:`.hybrid`) and LoRA (:mod:`.megatron_lora`) are refused at construction; under
  ``router_replay`` the micro-batch's ``routed_experts`` go with the plan, and an ``R2``
  recording forward's routes reach verl per plain token through its own
  ``merge_router_topk_indices`` call (:func:`patch_route_merge`, :mod:`.routing_replay`). With
  sharing off every method is verl's own;
- ``verl.workers.engine.utils``: the dynamic-batch-size split keeps sharing groups together
  (:mod:`.microbatch`).
- ``verl.trainer.ppo.ray_trainer`` / ``verl.trainer.ppo.v1.trainer_base``: the trainer's
  data-parallel balancing keeps sharing groups on one rank (:mod:`.balancing`).

Layer-spec hooks, whichever bridge the engine uses: Megatron-Bridge's
``provider.transformer_layer_spec`` (a spec or a spec factory, whose signature Megatron-Bridge
inspects) and the vanilla mbridge's ``bridge._get_transformer_layer_spec`` (patched per engine
instance right after ``_build_tf_config``, so the reference model without an overlay keeps the
stock spec).

What differs per release: verl 0.9.1 builds with Megatron-Bridge by default (and sets the spec
on the provider itself for QAT); 0.8.0 defaults to the vanilla mbridge
(``megatron.vanilla_mbridge=True``), which builds its TE layer spec lazily inside
``bridge.get_model``. 0.8.0 is also the release where PrefixGrouper lives (``use_prefix_grouper``,
wired to its legacy FSDP actor only); these sets extend the switch to the Megatron engine.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from .balancing import balancing_hooks
from .config import config_hooks
from .engine import SharingEngineMixin, install_engines
from .microbatch import active_split, patch_prepare_micro_batches
from .patchsets import register_releases
from .switched_off import off_hooks

__all__ = ["PATCHSETS", "share_layer_spec", "install_layer_spec", "patch_forward_fn_lookup",
           "patch_engine", "patch_route_merge", "current_micro_batch"]

# The forward keywords (sharing, groups, calculate_entropy, metrics, routes, the R2 recorder,
# and the cross-micro-batch part or None) of the micro-batch being run; None outside a sharing
# engine's forward_step.
_CURRENT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("prefix_sharing_mb",
                                                                     default=None)


@contextlib.contextmanager
def current_micro_batch(forward_kwargs: dict) -> Iterator[None]:
    """Within this block, verl's forward-fn lookup returns ``shared_forward(**forward_kwargs)``."""
    token = _CURRENT.set(forward_kwargs)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def share_layer_spec(spec: Any) -> Any:
    """The prefix-sharing version of a GPT layer spec or of a decoder block spec (all layers)."""
    from ..megatron_ext import with_prefix_sharing

    return with_prefix_sharing(spec)


def _sharing_spec_factory(factory: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a spec factory (keeps its signature: Megatron-Bridge inspects it for ``vp_stage``)."""

    @functools.wraps(factory)
    def shared(*args: Any, **kwargs: Any) -> Any:
        return share_layer_spec(factory(*args, **kwargs))

    return shared


def install_layer_spec(engine: Any) -> None:
    """Makes ``engine`` build its model with the prefix-sharing layer spec (after
    ``_build_tf_config``: the model itself is built later, in ``_build_megatron_module``)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    provider = getattr(engine, "provider", None)
    if provider is not None:  # Megatron-Bridge (verl 0.9's default): a spec or a spec factory
        spec = provider.transformer_layer_spec
        is_spec = isinstance(spec, (ModuleSpec, TransformerBlockSubmodules))
        provider.transformer_layer_spec = (
            share_layer_spec(spec) if is_spec else _sharing_spec_factory(spec))
    else:  # vanilla mbridge: the spec is built lazily in bridge.get_model; patch this instance
        bridge = engine.bridge
        bridge._get_transformer_layer_spec = _sharing_spec_factory(
            bridge._get_transformer_layer_spec)


def patch_forward_fn_lookup(module: ModuleType) -> None:
    """Hook on ``verl.models.mcore``: both forward-fn lookups (``get_mcore_engine_forward_fn``
    and, under ``use_fused_kernels``, ``get_mcore_forward_fused_model_engine_fn``) answer the
    shared forward while a sharing engine runs a micro-batch. Idempotent."""
    from .mcore import shared_forward, shared_fused_forward

    _share_lookup(module, "get_mcore_engine_forward_fn", shared_forward)
    _share_lookup(module, "get_mcore_forward_fused_model_engine_fn", shared_fused_forward,
                  passed_by_verl=("calculate_entropy",))


def _share_lookup(module: ModuleType, name: str, shared: Callable[..., Any],
                  passed_by_verl: tuple[str, ...] = ()) -> None:
    """``module.name(hf_config)`` returns ``shared`` bound to the current micro-batch's
    keywords (less those verl's call passes itself: ``passed_by_verl``) while one runs, or
    :func:`.cross_schedule.cross_forward` for a micro-batch of a group run across micro-batches;
    verl's own function otherwise, which is also the self-check's reference."""
    from .cross_schedule import cross_forward

    stock = getattr(module, name)
    if getattr(stock, "_prefix_sharing", False):
        return

    @functools.wraps(stock)
    def lookup(hf_config):
        current = _CURRENT.get()
        if current is None:
            return stock(hf_config)
        if current.get("part") is not None:  # a micro-batch of a cross-micro-batch group
            return functools.partial(cross_forward, **current)
        forward_kwargs = {k: v for k, v in current.items()
                          if k != "part" and k not in passed_by_verl}
        if forward_kwargs.get("self_check") is not None:  # the reference: verl's own forward
            forward_kwargs["stock_forward"] = stock(hf_config)
        return functools.partial(shared, **forward_kwargs)

    lookup._prefix_sharing = True
    setattr(module, name, lookup)


def patch_engine(module: ModuleType) -> None:
    """Hook on ``verl.workers.engine.megatron.transformer_impl``: defines
    ``PrefixSharingMegatronEngine`` there and registers it in place of verl's
    ``MegatronEngineWithLMHead``."""
    from verl.utils import tensordict_utils as tu

    from .config import sharing_config
    from .critic import value_head_problems
    from .cross_schedule import cross_schedule
    from .hybrid import hybrid_release_problem
    from .mcore import fused_kernel_problems, micro_batch_groups, virtual_pipeline_problems
    from .mcore_mtp import mtp_problems, share_verl_mtp, trains_mtp
    from .mcore_vlm import vision_model_problem
    from .mcore_model import model_build_problems
    from .megatron_lora import megatron_lora_problem
    from .routing_replay import RouteRecorder, micro_batch_routes, replay_mode

    def sharing_engine(stock: type, value_head: bool) -> type:
        """The sharing subclass of ``stock`` (verl's language-model engine, or its value-model
        engine with ``value_head``: the critic, :mod:`.critic`)."""

        class PrefixSharingMegatronEngine(SharingEngineMixin, stock):
            """verl's ``MegatronEngineWithLMHead``, computing each micro-batch's shared prefixes
            once."""

            # use_fused_kernels: the head in chunks from hidden states (shared_fused_forward)
            serves_fused_kernels = True
            serves_mtp = True  # model.mtp.enable_train: each depth planned (.mcore_mtp)

            @classmethod
            def setup_problems(cls, model_config: Any, engine_config: Any) -> list:
                """The model's refusals on this engine (a vision tower, a GDN hybrid on this
                megatron-core, LoRA) before the common ones, which they make moot; then the
                critic's (:func:`.critic.value_head_problems`) and where ``use_fused_kernels``
                is not served (:func:`.mcore.fused_kernel_problems`), interleaved
                pipeline stages (:func:`.mcore.virtual_pipeline_problems`), and what the
                sharing layers will refuse when the model is built
                (:func:`.mcore_model.model_build_problems`)."""
                sharing = sharing_config(engine_config)
                if sharing.enabled:
                    found = [problem for problem in (vision_model_problem(model_config),
                                                     hybrid_release_problem(model_config),
                                                     megatron_lora_problem(model_config)) if problem]
                    if found:
                        return found
                found = super().setup_problems(model_config, engine_config)
                if sharing.enabled:
                    if cls.value_head:
                        found += value_head_problems(engine_config)
                    found += fused_kernel_problems(engine_config, model_config, sharing)
                    found += virtual_pipeline_problems(engine_config)
                    found += mtp_problems(model_config, engine_config, sharing)
                    found += model_build_problems(model_config, engine_config)
                return found

            def _maybe_enable_fused_kernels(self) -> None:
                """verl's fused forward patch comes off again with sharing on: the shared
                forward calls the model unpatched and scores from its hidden states itself."""
                super()._maybe_enable_fused_kernels()
                if self.prefix_sharing.enabled and self.engine_config.use_fused_kernels:
                    from verl.models.mcore.model_forward_fused import unpatch_fused_forward

                    for chunk in self.module:
                        unpatch_fused_forward(chunk)

            def initialize(self) -> None:
                """verl's, then the MTP layers (built and patched by verl) score their
                depths on their own layouts with verl's gradient rule (:mod:`.mcore_mtp`)."""
                super().initialize()
                if self.prefix_sharing.enabled and getattr(self.model_config.mtp, "enable",
                                                           False):
                    share_verl_mtp(self.module, self.model_config)

            def _build_tf_config(self) -> None:
                super()._build_tf_config()
                if self.prefix_sharing.enabled:
                    install_layer_spec(self)

            def order_sensitive_statistics(self) -> str | None:
                """A MoE router's auxiliary or z-loss, and the MTP loss verl trains: megatron
                takes them per micro-batch, so fixed micro-batches keep verl's sample order
                (:func:`.microbatch.fixed_order`) and dynamic bsz verl's split
                (:func:`.microbatch.dynamic_split_problem`)."""
                config = getattr(self, "tf_config", None)
                aux = getattr(config, "moe_aux_loss_coeff", 0) or 0
                aux = any(aux) if isinstance(aux, list) else bool(aux)
                if getattr(config, "num_moe_experts", None) and (
                        aux or getattr(config, "moe_z_loss_coeff", None)):
                    return "the MoE router's auxiliary / z-loss is taken per micro-batch"
                if getattr(config, "mtp_num_layers", None) and trains_mtp(
                        getattr(self, "model_config", None)):
                    return "the MTP loss is averaged per micro-batch"
                return None

            def forward_backward_batch(self, data: Any, loss_function: Any,
                                       forward_only: bool = False) -> Any:
                """The sharing engine's step; with ``cross_micro_batch`` megatron's schedule
                runs the cross groups' block steps among verl's micro-batches
                (:mod:`.cross_schedule`)."""
                if not (self.prefix_sharing.enabled and self.prefix_sharing.cross_micro_batch):
                    return super().forward_backward_batch(data, loss_function, forward_only)
                with cross_schedule(module, value_model=value_head):
                    return super().forward_backward_batch(data, loss_function, forward_only)

            def forward_step(self, batch_iter, model, logits_processor_func,
                             postprocess_micro_batch_func):
                if not self.prefix_sharing.enabled:
                    return super().forward_step(batch_iter, model, logits_processor_func,
                                                postprocess_micro_batch_func)
                batch = next(batch_iter)
                self.refuse_unsupported_switches(batch)
                groups = None
                if self.prefix_sharing.mode == "prompt_only":
                    groups = micro_batch_groups(batch, batch["input_ids"].size(0))
                record = active_split()
                mode = replay_mode(self.engine_config)
                forward_kwargs = dict(
                    sharing=self.prefix_sharing, groups=groups,
                    calculate_entropy=tu.get_non_tensor_data(batch, key="calculate_entropy",
                                                             default=False),
                    metrics=self._sharing_metrics,
                    replay_routes=micro_batch_routes(batch, mode),
                    route_recorder=RouteRecorder() if mode == "R2" else None,
                    part=None if record is None else record.part(batch),
                )
                if forward_kwargs["part"] is None and self._self_check.pending:
                    forward_kwargs["self_check"] = self._self_check  # shared_forward runs it
                with current_micro_batch(forward_kwargs):
                    return super().forward_step(iter([batch]), model, logits_processor_func,
                                                postprocess_micro_batch_func)

        PrefixSharingMegatronEngine.value_head = value_head
        return PrefixSharingMegatronEngine

    install_engines(module, sharing_engine, (
        ("MegatronEngineWithLMHead", "PrefixSharingMegatronEngine", False),
        ("MegatronEngineWithValueHead", "PrefixSharingMegatronValueEngine", True)))
    patch_route_merge(module)


def patch_route_merge(module: ModuleType) -> None:
    """``merge_router_topk_indices`` in ``module`` (verl's Megatron engine, which calls it in
    ``forward_step`` after an ``R2`` recording forward) appends the sharing forward's routes
    per plain token (:class:`.routing_replay.RouteRecorder`) for a sharing micro-batch, and is
    verl's own otherwise. Idempotent."""
    stock = module.merge_router_topk_indices
    if getattr(stock, "_prefix_sharing", False):
        return

    @functools.wraps(stock)
    def merge_router_topk_indices(attention_mask, input_ids, mini_layer_topk_idx_list,
                                  *args: Any, **kwargs: Any) -> None:
        current = _CURRENT.get()
        recorder = None if current is None else current.get("route_recorder")
        if recorder is None:
            return stock(attention_mask, input_ids, mini_layer_topk_idx_list, *args, **kwargs)
        mini_layer_topk_idx_list.append(recorder.merged())

    merge_router_topk_indices._prefix_sharing = True
    module.merge_router_topk_indices = merge_router_topk_indices


PATCHSETS = register_releases(
    "mcore",
    hooks={
        **config_hooks(("McoreActorConfig",), ("McoreCriticConfig",), ("McoreEngineConfig",)),
        "verl.models.mcore": patch_forward_fn_lookup,
        "verl.workers.engine.megatron.transformer_impl": patch_engine,
        "verl.workers.engine.utils": patch_prepare_micro_batches,
        **balancing_hooks(),
    },
    summary="verl {release} Megatron engine: actor config, layer spec, forward, "
            "group-keeping micro-batches, metrics",
    off_hooks=off_hooks(("McoreActorConfig",), ("McoreCriticConfig",), ("McoreEngineConfig",)),
)
