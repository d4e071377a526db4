"""A state that is not a commpress state dict (None, a list, another library's dict, a
whole job of junk) gets one clear message from every loader, never a TypeError or
KeyError from inside it (issue 40: ``CommState.load_state_dict(None)`` raised
``argument of type 'NoneType' is not iterable``)."""

from __future__ import annotations

import pytest
import torch

from commpress import CommState, ConfigError
from commpress.comm import SimulatedWorld
from commpress.comm.averager import ParameterAverager
from commpress.local_sgd import LocalSGD
from commpress.optim import AtTheStep, OneBitAdam
from commpress.parts import DDPHook
from commpress.registration import Registration

JUNK = [
    None,
    [],
    "state.pt",
    {"weights": torch.zeros(2)},
    {"ranks": None, "world_size": 1},
    {"ranks": [None], "world_size": 1},
    {"ranks": [{"step": 0}], "world_size": 1},
]
NOT_A_STATE = r"the state .*: it is not a commpress state dict of this version \(save it again with state_dict\(\)\)"


def _loaders():
    """Each loader of per-rank state, on one simulated rank, named."""
    model = torch.nn.Linear(3, 2)
    backend = lambda: SimulatedWorld(1).backends[0]  # noqa: E731
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {
        "CommState before it connects": CommState({"method": "fp16"}),
        "CommState": CommState({"method": "topk", "params": {"ratio": 0.5}}, backend=backend()),
        "LocalSGD": LocalSGD(model, sgd, period=2, averager=ParameterAverager("none", backend=backend())),
        "OneBitAdam": OneBitAdam(adamw, model.named_parameters(), AtTheStep(ParameterAverager("none", backend=backend())), 2),
    }


@pytest.mark.parametrize("junk", JUNK, ids=lambda j: type(j).__name__ if not isinstance(j, dict) else ",".join(j))
@pytest.mark.parametrize("name", list(_loaders()))
def test_every_loader_refuses_junk_with_one_message(name, junk):
    loader = _loaders()[name]
    with pytest.raises(ValueError, match=NOT_A_STATE):
        loader.load_state_dict(junk)


def test_a_good_state_still_loads():
    state = CommState({"method": "topk", "params": {"ratio": 0.5}}, backend=SimulatedWorld(1).backends[0])
    state.load_state_dict(state.state_dict())


@pytest.mark.parametrize("junk", [None, [], "state.pt"])
def test_a_registration_refuses_junk_naming_what_it_applies(junk):
    with pytest.raises(ConfigError, match=r"the state is not a dict; this registration applies ddp_hook: load a state saved"):
        Registration(CommState({"method": "fp16"}).config, [DDPHook(CommState({"method": "fp16"}))]).load_state_dict(junk)
