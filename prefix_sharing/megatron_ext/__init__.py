"""Megatron-core adapter: a GPT layer spec whose attention shares prefixes, and its inputs.

    from prefix_sharing.megatron_ext import get_gpt_layer_local_spec, prepare_micro_batch

    model = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(), ...)
    mb = prepare_micro_batch(sequences, PrefixSharingConfig())
    stats = forward_token_stats(model, mb)          # log-probs + entropy, packed per sequence

Importing this package imports megatron-core (and fails with a clear message without it, or
with a release it is not tested on: see :mod:`.release`). ``HybridModel`` stacks (megatron-core
0.18+) are in :mod:`.hybrid`, imported only when asked for, so older releases import this
package as before.
On Ascend, import ``mindspeed.megatron_adaptor`` first: it replaces classes this package
subclasses.
"""

import importlib.util

if importlib.util.find_spec("megatron.core") is None:
    raise ImportError(
        "prefix_sharing.megatron_ext needs megatron-core (pip install 'prefix-sharing[megatron]')"
    )

from .release import check_release  # noqa: E402

check_release()

from .checks import UnsupportedSetupError, assert_same_plan  # noqa: E402
from .core_attention import PrefixSharingCoreAttention  # noqa: E402
from .layer_specs import (  # noqa: E402
    UnsupportedSpecError,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    register_spec_form,
    with_prefix_sharing,
)
from .logprobs import (forward_token_stats, head_token_stats, lm_head_inputs,  # noqa: E402
                       token_stats)
from .mla import PrefixSharingMLASelfAttention  # noqa: E402
from .model_check import check_sharing_model  # noqa: E402
from .moe import PrefixSharingRouter, PrefixSharingTransformerLayer  # noqa: E402
from .mtp import PrefixSharingMTPLayer, share_multi_token_prediction  # noqa: E402
from .packed_seq import MicroBatch, PlanPackedSeqParams, prepare_micro_batch  # noqa: E402
from .self_attention import PrefixSharingSelfAttention  # noqa: E402

__all__ = [
    "MicroBatch",
    "PlanPackedSeqParams",
    "PrefixSharingCoreAttention",
    "PrefixSharingMLASelfAttention",
    "PrefixSharingMTPLayer",
    "PrefixSharingRouter",
    "PrefixSharingSelfAttention",
    "PrefixSharingTransformerLayer",
    "UnsupportedSetupError",
    "UnsupportedSpecError",
    "assert_same_plan",
    "check_sharing_model",
    "forward_token_stats",
    "head_token_stats",
    "lm_head_inputs",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
    "prepare_micro_batch",
    "register_spec_form",
    "share_multi_token_prediction",
    "token_stats",
    "with_prefix_sharing",
]
