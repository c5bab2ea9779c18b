"""verl's plugin entry point (``verl.plugins`` in setup.cfg): installing the project is enough.

verl 0.9.1's ``verl/__init__.py`` loads every entry point of the group ``verl.plugins`` at the end
of ``import verl``, in the driver and in every Ray worker. Loading this module imports
``prefix_sharing``, whose import activates the patch sets (:mod:`.activation`): a finder on
``sys.meta_path`` that runs each hook when verl imports the module it targets, and the hooks of
targeted modules verl has already imported. Nothing else runs here: verl is still mid-import, and
no verl module is imported by this one. ``ENABLE_PREFIX_SHARING=0`` is honoured as at any import
of ``prefix_sharing`` (only the config acceptance is patched), and
``VERL_USE_EXTERNAL_PLUGINS=none`` (verl's own switch) leaves this module unloaded.

verl logs a plugin that fails to load at debug level only and goes on stock: an error here
(``ENABLE_PREFIX_SHARING`` other than 0 or 1, say) is logged at error level before verl sees it.

verl 0.8.0 has no entry-point discovery: there, ``actor_rollout_ref.model.external_lib:
prefix_sharing`` (or ``VERL_USE_EXTERNAL_MODULES=prefix_sharing``) loads the project.
"""

import logging

try:
    import prefix_sharing  # noqa: F401  (its import activates the verl patch sets)
except Exception:
    logging.getLogger(__name__).exception("prefix-sharing: verl's plugin failed to load")
    raise
