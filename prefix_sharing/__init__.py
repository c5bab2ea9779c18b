"""prefix-sharing: compute every shared token prefix of a micro-batch once, with unchanged results.

The core - config, planner, plan, attention and log-probs - is pure torch and numpy. Framework
adapters (``prefix_sharing.megatron_ext``, ``.npu``, ``.fsdp_compat``) import their framework
only when they are imported themselves.
"""

from .config import PrefixSharingConfig
from .plan import SharingPlan
from .planner import PromptGroup, build_plan, prompt_groups

__version__ = "0.1.0"

from .verl_ext.activation import activate as _activate_verl  # noqa: E402

_activate_verl()  # patches verl when (if ever) it is imported; ENABLE_PREFIX_SHARING=0: stock verl

from . import setup  # noqa: E402  (the prototype's prefix_sharing.setup.install)

__all__ = [
    "PrefixSharingConfig",
    "PromptGroup",
    "SharingPlan",
    "build_plan",
    "prompt_groups",
    "setup",
]
