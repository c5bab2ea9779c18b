"""What every prefix-sharing verl engine (Megatron, MindSpeed, FSDP) does the same way.

:class:`SharingEngineMixin` goes first in an engine subclass's bases, before verl's engine: it
reads the sharing config the actor config attached to the engine config, refuses the settings
sharing cannot honour (at construction, and per micro-batch: :meth:`refuse_unsupported_switches`),
and runs verl's ``forward_backward_batch`` inside the group-keeping split (:mod:`.microbatch`:
dynamic bsz, or fixed micro-batches by the samples' order), adding the step's token counts, the
split's figures and the first-step self-check's (:mod:`.self_check`, which the engine's forward runs) to verl's
metrics. What differs per engine (how the model is built and how a micro-batch is run)
stays in the engine's own subclass. :func:`install_engine` puts a subclass where verl looks for
its engine; :func:`registered_engine` is the class verl's registry selects. Nothing here imports verl at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..refusals import Refused, refuse_all
from .config import sharing_config
from .mcore import PrefixSharingSetupError, SharingMetrics, check_engine_setup
from .microbatch import (add_split_metrics, dynamic_split_problem, fixed_order,
                         restore_sample_order, select_samples, sharing_split)
from .routing_replay import replay_mode
from .self_check import FirstStepSelfCheck, self_check_problems
from .ulysses import recurrent_layer_types

__all__ = ["SharingEngineMixin", "install_engine", "install_engines", "register_engine",
           "registered_engine",
           "UNSUPPORTED_SWITCHES"]

# Micro-batch switches both verl engines read (a micro-batch may override the engine config's
# use_fused_kernels) that need per-sample labels or logits, which the flat layout does not have;
# use_fused_kernels only where the engine does not serve it (serves_fused_kernels).
UNSUPPORTED_SWITCHES = ("calculate_sum_pi_squared", "distillation_use_topk", "distillation_only",
                        "use_fused_kernels")


class SharingEngineMixin:
    """The step-level half of a prefix-sharing verl engine (see the module doc).

    Attributes set before verl's ``__init__`` runs:
        prefix_sharing: the validated :class:`~prefix_sharing.config.PrefixSharingConfig`
            (``mode="off"`` when the actor config has no ``prefix_grouper`` block: with it off,
            every method is verl's own).
        _sharing_metrics: the current step's token counts; the engine's forward adds each
            micro-batch's plan to it.
        _self_check: the first-step self-check (``prefix_grouper.self_check``), which the
            engine's forward runs on its first sharing micro-batch.
    """

    # Whether a one-level cross group's prefix is planned beside its tails (the Megatron engine,
    # which keeps its graph from its forward step to its backward step at PP=1); the FSDP
    # engine computes every block again, so every cross group nests there.
    keeps_cross_prefix = True
    # The vision-language model types the engine's forward serves (the FSDP engine's: .vlm).
    vision_families: tuple[str, ...] = ()
    # Whether the engine serves use_fused_kernels (the FSDP engine's chunked sharing head).
    serves_fused_kernels = False
    # Whether the engine trains MTP layers (model.mtp.enable_train: the Megatron engine's).
    serves_mtp = False

    def __init__(self, model_config: Any, engine_config: Any, *args: Any, **kwargs: Any) -> None:
        self.prefix_sharing = sharing_config(engine_config)
        found = self.setup_problems(model_config, engine_config)
        if found:
            raise refuse_all(found, error=PrefixSharingSetupError,
                             advice="Change the setting, or turn sharing off "
                                    "(use_prefix_grouper: false).")
        self._sharing_metrics = SharingMetrics()
        self._self_check = FirstStepSelfCheck(self.prefix_sharing.enabled
                                              and self.prefix_sharing.self_check)
        super().__init__(model_config, engine_config, *args, **kwargs)

    @classmethod
    def setup_problems(cls, model_config: Any, engine_config: Any) -> list[Refused]:
        """Every setting this engine refuses at construction for these configs (verl's
        ``HFModelConfig`` and the engine config the actor config built), without building
        anything: what ``__init__`` raises, and what ``prefix-sharing preflight`` reports.

        With sharing on, :func:`.mcore.check_engine_setup`; with ``self_check``,
        :func:`.self_check.self_check_problems`; with ``cross_micro_batch``, a model with
        recurrent layers (their state is not among what a shared block hands its readers).
        """
        sharing = sharing_config(engine_config)
        found = []
        if sharing.enabled:
            found += _problems(check_engine_setup, engine_config, model_config,
                               vision_families=cls.vision_families,
                               serves_fused_kernels=cls.serves_fused_kernels,
                               serves_mtp=cls.serves_mtp)
        recurrent = recurrent_layer_types(getattr(model_config, "hf_config", None))
        if sharing.enabled and sharing.cross_micro_batch and recurrent:
            found.append(Refused("verl.cross_micro_batch.recurrent",
                                 f"prefix_grouper.cross_micro_batch=true with the model's "
                                 f"{', '.join(sorted(recurrent))} layers"))
        if sharing.enabled and sharing.self_check:
            found += self_check_problems(engine_config)
        return found

    def forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False):
        if not self.prefix_sharing.enabled:
            return super().forward_backward_batch(data, loss_function, forward_only)
        self._sharing_metrics = SharingMetrics()
        # dynamic bsz keeps groups together (across micro-batches cut on tokens and routes)
        # unless the loss or the model's statistics depend on its micro-batches (groups run
        # across micro-batches on purpose take their own statistics' rule,
        # docs/cross-micro-batch.md); fixed micro-batches keep them whole by the order of the
        # samples
        cross = self.prefix_sharing.cross_micro_batch
        with sharing_split(self.prefix_sharing, replay_mode(getattr(self, "engine_config", None)),
                           self.cross_row_multiple(), self.keeps_cross_prefix) as split:
            dynamic_split_problem(data, split, loss_function, forward_only,
                                  None if cross else self.order_sensitive_statistics())
            order = fixed_order(data, split, loss_function, forward_only,
                                self.order_sensitive_statistics())
            if order is not None:
                data = select_samples(data, order)
            output = super().forward_backward_batch(data, loss_function, forward_only)
        if order is not None:
            restore_sample_order(output, order)
        if output:  # empty on a Megatron engine's inner pipeline stages
            output.setdefault("metrics", {}).update(self._sharing_metrics.as_verl_metrics())
            output["metrics"].update(self._self_check.pop_metrics())
            add_split_metrics(output, split)
        return output

    def cross_row_multiple(self) -> int | None:
        """What a cross group's plans are padded to, or None for megatron's parallel sizes
        (:func:`.microbatch.sharing_split`); the FSDP engine answers its Ulysses size."""
        return None

    def order_sensitive_statistics(self) -> str | None:
        """Why this engine's model makes a training step depend on which samples share a
        micro-batch (statistics taken per micro-batch, such as a router's auxiliary loss),
        or ``None``; the Megatron engine answers (:func:`.microbatch.fixed_order`)."""
        return None

    @classmethod
    def refuse_unsupported_switches(cls, micro_batch: Any, *extra: Refused) -> None:
        """Raises :class:`~.mcore.PrefixSharingSetupError` naming every
        :data:`UNSUPPORTED_SWITCHES` entry set on ``micro_batch`` (``use_fused_kernels`` only
        where the engine does not serve it), plus the engine's own ``extra`` refusals."""
        from verl.utils import tensordict_utils as tu

        served = ("use_fused_kernels",) if cls.serves_fused_kernels else ()
        found = [Refused("verl.micro_batch_switch", key) for key in UNSUPPORTED_SWITCHES
                 if key not in served
                 and tu.get_non_tensor_data(micro_batch, key=key, default=False)]
        found += extra
        if found:
            raise refuse_all(found, error=PrefixSharingSetupError)



def _problems(check: Any, *args: Any, **kwargs: Any) -> list[Refused]:
    """The refusals a raising check (``check(*args, **kwargs)``) finds, as a list."""
    try:
        check(*args, **kwargs)
    except PrefixSharingSetupError as error:
        return list(error.found)
    return []


def install_engines(module: ModuleType, build: Callable[[type, bool], type],
                    engines: tuple[tuple[str, str, bool], ...]) -> None:
    """For each ``(stock, name, value_head)``: the class ``build(module.<stock>, value_head)``
    (an engine's sharing subclass of verl's language-model or, with ``value_head``,
    value-model engine), named ``name``, installed in its place (:func:`install_engine`)."""
    for stock_name, name, value_head in engines:
        stock = getattr(module, stock_name)
        engine = build(stock, value_head)
        engine.__name__ = name
        install_engine(module, stock, engine)


def install_engine(module: ModuleType, stock: type, engine: type) -> None:
    """Makes ``engine`` (a subclass of ``stock``) verl's engine wherever ``stock`` was: an
    attribute of ``module`` (verl's engine module, where pickling and logs look for it, in every
    process) and what verl's engine registry selects (:func:`register_engine`)."""
    engine.__module__ = module.__name__
    engine.__qualname__ = engine.__name__
    setattr(module, engine.__name__, engine)
    register_engine(stock, engine)


def register_engine(stock: type, replacement: type) -> None:
    """Makes verl's ``EngineRegistry`` select ``replacement`` wherever it selects ``stock`` (every
    model type, backend and device ``stock`` is registered for).

    verl 0.9.1: through the public decorator's vendor key, for every vendor of a platform
    registered for that device (``nvidia`` and ``amd`` on cuda, ``huawei`` on npu, a plugin's
    own): ``get_engine_cls`` tries ``(device, vendor)`` before the device alone, where
    ``stock`` stays. A platform registered after the engine module is imported gets ``stock``.
    verl 0.8.0's registry has no vendor key and ``register`` keeps an existing entry, so there
    the entries are replaced in place."""
    import inspect

    from verl.workers.engine.base import EngineRegistry

    vendor_keys = "vendor" in inspect.signature(EngineRegistry.register).parameters
    vendors = _platform_vendors() if vendor_keys else {}
    for model_type, backends in EngineRegistry._engines.items():
        for backend, by_key in backends.items():
            devices = [key for key, cls in by_key.items() if cls is stock and isinstance(key, str)]
            for device in devices:
                if not vendor_keys:
                    by_key[device] = replacement
                    continue
                free = [v for v in vendors.get(device, ()) if (device, v) not in by_key]
                if free:
                    EngineRegistry.register(model_type, backend, device, vendor=free)(replacement)


def _platform_vendors() -> dict[str, list[str]]:
    """verl 0.9.1's registered platforms as ``{device: [vendor, ...]}``."""
    from verl.plugin.platform import PlatformRegistry

    vendors: dict[str, list[str]] = {}
    for name in PlatformRegistry.registered_names():
        platform = PlatformRegistry.get(name)()
        vendors.setdefault(platform.device_name, []).append(platform.vendor_name)
    return vendors


def registered_engine(model_type: str, backend: str, device: str = "cuda",
                      vendor: str = "nvidia") -> type:
    """The engine class verl's ``EngineRegistry`` selects for ``backend`` on ``device`` of
    ``vendor`` (its vendor key first, then the device's; 0.8.0 has device keys only)."""
    from verl.workers.engine.base import EngineRegistry

    registry = EngineRegistry._engines[model_type][backend]
    return registry.get((device, vendor)) or registry[device]
