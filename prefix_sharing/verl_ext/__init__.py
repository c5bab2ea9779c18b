"""verl integration: ``prefix_grouper.mode`` in verl's actor config, in verl's own engines.

``import prefix_sharing`` activates it (see :mod:`.activation`): every patch set that targets
the installed verl release is applied when verl imports the modules it changes, in the driver
and in every Ray worker that imports ``prefix_sharing`` (verl 0.9.1 loads it as a plugin,
:mod:`.plugin`; 0.8.0 through ``actor_rollout_ref.model.external_lib: prefix_sharing``).
Nothing here imports verl eagerly.

Switches (environment): ``ENABLE_PREFIX_SHARING=0`` runs verl's stock computation with the same
config (only the config acceptance is patched: :mod:`.switched_off`);
``PREFIX_SHARING_PATCHSET=verl091_mcore[,...]`` applies only the named sets (and forces them on
an untested verl release), in the project's spelling or the prototype's
(``verl080_mcore0161_ms0160``: :mod:`.names`). ``prefix_sharing.setup`` is the prototype's name
for :func:`install`.

API, for patch-set modules and for explicit use:

- :func:`install` (``patchsets=None``): activate now; names (a list or a comma-separated
  string) force specific sets.
- :func:`installed`: the patch sets applied so far in this process.
- :class:`PatchSet` / :func:`register`: declare a patch set (name, verl releases,
  ``{verl module: hook}``); list the module in ``patchsets.BUILTIN_MODULES``.
- :func:`accept_prefix_grouper` (``.config``): make a verl actor-config dataclass accept
  ``prefix_grouper`` and carry the validated config to its engine config;
  :func:`sharing_config` reads it back in the engine.
- ``.mcore``: the version-neutral pieces (``shared_forward``, ``check_engine_setup``,
  ``micro_batch_groups``, ``SharingMetrics``); ``.engine``: what every sharing engine does alike;
  ``.hybrid``: the Megatron engine's refusal of Gated DeltaNet hybrids before megatron-core 0.19.2;
  ``.mcore_mtp``: its MTP training (each depth planned with verl's loss mask, verl's gradient
  rule).
- Patch-set modules, one per verl engine, each registering a set per supported release:
  ``.mcore_engine`` (``verl*_mcore``: layer spec, forward-fn lookup, engine subclass),
  ``.mindspeed`` (``verl*_mcore_mindspeed``) and ``.fsdp`` (``verl*_fsdp``; ``.vlm``: its
  vision-language micro-batches).
  ``.balancing``: the trainer's data-parallel balancing (both trainers), hooked by every
  engine's set.
"""

from .activation import UnsupportedVerlVersion, install, installed
from .config import accept_prefix_grouper, sharing_config
from .patchsets import PatchSet, register, registered

__all__ = [
    "PatchSet",
    "UnsupportedVerlVersion",
    "accept_prefix_grouper",
    "install",
    "installed",
    "register",
    "registered",
    "sharing_config",
]
