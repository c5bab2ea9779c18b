"""What every prefix-sharing verl engine refuses alike, whichever supported verl is installed:
a micro-batch switch that needs per-sample labels or logits raises one error naming it, in the
Megatron engine as in the FSDP engine (both call ``refuse_unsupported_switches``)."""

import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.errors import UnsupportedSetup  # noqa: E402
from prefix_sharing.refusals import Refused  # noqa: E402
from prefix_sharing.verl_ext.engine import UNSUPPORTED_SWITCHES, SharingEngineMixin  # noqa: E402
from prefix_sharing.verl_ext.mcore import PrefixSharingSetupError  # noqa: E402
from tests.verl_ext._batch import make_batch, use_cpu_platform  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def cpu_platform():
    """verl 0.8.0's unpadding (used by make_batch) otherwise imports flash_attn."""
    use_cpu_platform()


def test_a_plain_micro_batch_passes():
    SharingEngineMixin.refuse_unsupported_switches(make_batch("grpo"))


@pytest.mark.parametrize("switch", UNSUPPORTED_SWITCHES)
def test_each_switch_is_refused_by_name(switch):
    from verl.utils import tensordict_utils as tu

    batch = make_batch("grpo")
    tu.assign_non_tensor(batch, **{switch: True})
    with pytest.raises(PrefixSharingSetupError,
                       match=rf"per-sample logits \({switch}\): .*\[verl\.micro_batch_switch\]$"):
        SharingEngineMixin.refuse_unsupported_switches(batch)


def test_the_engines_own_problems_join_the_same_error():
    from verl.utils import tensordict_utils as tu

    batch = make_batch("grpo")
    tu.assign_non_tensor(batch, distillation_only=True)
    with pytest.raises(PrefixSharingSetupError,
                       match=r"\(distillation_only\): .*\[verl\.micro_batch_switch\]; a multimodal "
                             r"model or inputs \(multi_modal_inputs\): .*\[verl\.multimodal\]$"):
        SharingEngineMixin.refuse_unsupported_switches(
            batch, Refused("verl.multimodal", "multi_modal_inputs"))


def test_a_refused_engine_setting_is_bad_input():
    """One line in the command, and still a ValueError for callers that catch it."""
    assert issubclass(PrefixSharingSetupError, UnsupportedSetup)
    assert issubclass(PrefixSharingSetupError, ValueError)


def test_groups_across_micro_batches_refuse_a_model_with_recurrent_layers():
    """A shared block hands its readers its K/V, not a recurrent layer's state: both engines
    refuse the option for such a model at construction (what preflight reports)."""
    from types import SimpleNamespace

    from prefix_sharing import PrefixSharingConfig

    class StockEngine:
        def __init__(self, model_config, engine_config):
            pass

    class Engine(SharingEngineMixin, StockEngine):
        pass

    hybrid = SimpleNamespace(hf_config=SimpleNamespace(
        layer_types=["linear_attention", "full_attention"]))
    dense = SimpleNamespace(hf_config=SimpleNamespace(layer_types=["full_attention"]))
    cross = SimpleNamespace(prefix_sharing=PrefixSharingConfig(cross_micro_batch=True))
    with pytest.raises(PrefixSharingSetupError,
                       match=r"linear_attention layers.*\[verl.cross_micro_batch.recurrent\]"):
        Engine(hybrid, cross)
    Engine(dense, cross)
    Engine(hybrid, SimpleNamespace(prefix_sharing=PrefixSharingConfig()))
