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
