"""InPlaceSwitch: a module of the kind becomes its sharing subclass in place (same object, same
parameters, the new forward), once; a stock one left in a model is refused, naming it."""

import pytest
import torch

from prefix_sharing.errors import UnsupportedSetup
from prefix_sharing.fsdp_compat.switch import InPlaceSwitch


class Mixer(torch.nn.Linear):
    pass


def _sharing_forward(self, x):
    return 2 * x


SWITCH = InPlaceSwitch("toy mixers", lambda m: isinstance(m, Mixer), _sharing_forward,
                       "_toy_switched")


def test_a_switched_module_keeps_its_parameters_and_runs_the_sharing_forward():
    model = torch.nn.Sequential(Mixer(2, 2), torch.nn.ReLU(), Mixer(2, 2))
    weights = [model[0].weight, model[2].weight]
    assert [SWITCH.switch(m) for m in model] == [True, False, True]
    assert [model[0].weight, model[2].weight] == weights
    assert type(model[0]) is type(model[2]) and type(model[0]).__name__ == "PrefixSharingMixer"
    assert isinstance(model[0], Mixer) and SWITCH.is_switched(model[0])
    x = torch.ones(1, 2)
    assert torch.equal(model[0](x), 2 * x)
    assert not SWITCH.switch(model[0])  # already switched
    SWITCH.check(model)


def test_a_stock_module_left_in_the_model_is_refused_by_name():
    model = torch.nn.Sequential(Mixer(2, 2), Mixer(2, 2))
    SWITCH.switch(model[0])
    with pytest.raises(UnsupportedSetup, match=r"\(stock toy mixers \(1\)\): it would carry"):

        SWITCH.check(model)


def test_a_planned_mixer_call_is_checked_once_for_every_mixer():
    """planned_mixer_inputs, the check the GDN and Mamba-2 sharing forwards share: the plan's
    schedule and the backend, or one error naming the mixer and what is wrong."""
    from types import SimpleNamespace

    from prefix_sharing import PrefixSharingConfig, build_plan
    from prefix_sharing.fsdp_compat.attention import BACKEND_KWARG, PLAN_KWARG
    from prefix_sharing.fsdp_compat.switch import planned_mixer_inputs
    from prefix_sharing.recurrent import recurrence_schedule

    plan = build_plan([[5, 6, 7, 8], [5, 6, 7, 9, 9]], PrefixSharingConfig(min_prefix_len=1))
    layer = SimpleNamespace(layer_idx=3)
    hidden = torch.zeros(1, plan.num_tokens_flat, 4)
    schedule, backend = planned_mixer_inputs(layer, "Mamba-2 mixer", hidden, None, None,
                                             {PLAN_KWARG: plan, BACKEND_KWARG: "torch"})
    assert schedule is recurrence_schedule(plan) and backend == "torch"
    for asked in (None, "auto", "fla"):
        kwargs = {PLAN_KWARG: plan} if asked is None else {PLAN_KWARG: plan, BACKEND_KWARG: asked}
        assert planned_mixer_inputs(layer, "x", hidden, None, None, kwargs)[1] == "auto"
    with pytest.raises(ValueError, match="layer 3's sharing Gated DeltaNet needs the micro-batch's plan"):
        planned_mixer_inputs(layer, "Gated DeltaNet", hidden, None, None, {})
    with pytest.raises(ValueError, match="the sharing Mamba-2 mixer takes no cache"):
        planned_mixer_inputs(layer, "Mamba-2 mixer", hidden, object(), None, {PLAN_KWARG: plan})
    with pytest.raises(ValueError, match="takes no cache .* and no attention_mask"):
        planned_mixer_inputs(layer, "Mamba-2 mixer", hidden, None, torch.ones(1, 7),
                             {PLAN_KWARG: plan})
    with pytest.raises(ValueError, match=r"one row of tokens; got \(2, 7, 4\)"):
        planned_mixer_inputs(layer, "Mamba-2 mixer", torch.zeros(2, 7, 4), None, None,
                             {PLAN_KWARG: plan})
