"""The paths around the compressors on CUDA gradients, checked without a GPU: the DDP hook
state (method groups, the step commit), the hierarchical reduction, Local SGD's averager
and the FSDP wire format.

Same technique and seams as ``test_fake_cuda.py`` (its ``fake_cuda`` fixture): fake CUDA
tensors under ``FakeTensorMode`` make any mix with a CPU tensor raise. The simulated backend
answers collectives; every collective must carry CUDA tensors. The one host read of the
hook state per step, ``hooks.state.step_was_finite``, is patched to "finite" (fake tensors
hold no data). Not covered: numbers, and the CuPy kernels themselves (recorded, not run).
"""

from __future__ import annotations

import pytest
import torch
from test_fake_cuda import CUDA, fake_cuda  # noqa: F401  (the fixture)

from commpress import CommState
from commpress.bandwidth.hierarchical import Place, hierarchical_reduction, hierarchy_scopes
from commpress.bandwidth.hierarchy import Hierarchy
from commpress.comm import SimulatedWorld
from commpress.comm.averager import ParameterAverager
from commpress.comm.simulated import SimulatedBackend
from commpress.compressors import Bucket, Context, build
from commpress.config import Config
from commpress.fsdp.wire import Segments, Wire

pytestmark = pytest.mark.usefixtures("fake_cuda")


@pytest.fixture
def checked_world(monkeypatch):
    """A SimulatedWorld factory whose backends refuse collectives on non-CUDA tensors."""
    start = SimulatedBackend._start

    def on_cuda_only(self, channel, request):
        assert request.tensor.device == CUDA, (channel, request.tensor.device)
        return start(self, channel, request)

    monkeypatch.setattr(SimulatedBackend, "_start", on_cuda_only)
    monkeypatch.setattr("commpress.hooks.state.step_was_finite", lambda flags: all(f.device == CUDA for f in flags))
    return SimulatedWorld


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(12, 10, device=CUDA), torch.nn.LayerNorm(10, device=CUDA), torch.nn.Linear(10, 6, device=CUDA)
    )


@pytest.mark.parametrize("method", ["none", "bf16", "powersgd", "acpsgd", "terngrad", "topk", "onebit"])
def test_the_hook_state_keeps_every_step_on_the_gradients_device(checked_world, method):
    config = {"method": method, "overrides": [{"params": ["*.bias"], "method": "fp16"}]}
    world = checked_world(2)
    models = [_model() for _ in range(2)]
    states = [CommState(config, model=m, backend=b) for m, b in zip(models, world.backends)]
    params = [list(m.parameters()) for m in models]
    for step in range(3):
        futures = []
        for state, ps in zip(states, params):
            for index, members in enumerate([ps[3:], ps[:3]]):  # DDP's order: last layer first
                buffer = torch.cat([torch.randn(p.shape, device=CUDA).reshape(-1) for p in members])
                futures.append(state.reduce(index, buffer, members, advance=index == 1))
        assert all(f.done() and f.value().device == CUDA for f in futures), step
    for state in states:
        saved = state.state_dict()  # commits the last step
        assert saved["step"] == 3
    resumed = CommState(config, model=models[0], backend=SimulatedWorld(1).backends[0])
    resumed.load_state_dict(states[0].state_dict())
    assert resumed.step == 3


@pytest.mark.parametrize("method", ["none", "powersgd", "topk"])
def test_the_hierarchical_reduction_stays_on_the_device(checked_world, method):
    plan = Hierarchy.of([[0, 1], [2, 3]])
    world = checked_world(4, hierarchy_scopes(plan, 4))
    comps = [build(method, {"rank": 2} if method == "powersgd" else {}) for _ in range(4)]
    names, shapes = ["w", "b", "v"], [(8, 6), (8,), (6, 4)]
    for step in range(2):
        buckets = [Bucket.from_tensors(0, [torch.randn(s, device=CUDA) for s in shapes], names) for _ in range(4)]
        world.run([hierarchical_reduction(b, step, Place.of(plan, r), comps[r].reduce) for r, b in enumerate(buckets)])
        assert all(b.buffer.device == CUDA for b in buckets)
        for c in comps:
            c.end_step(True)


def test_local_sgd_averaging_stays_on_the_device(checked_world):
    world = checked_world(2)
    averagers = [ParameterAverager("bf16", backend=b) for b in world.backends]
    buckets = [Bucket(0, torch.randn(100, device=CUDA)) for _ in range(2)]
    futures = [a.start(b) for a, b in zip(averagers, buckets)]
    assert all(f.done() and f.value().device == CUDA for f in futures)


def test_the_layerwise_plan_exchanges_on_the_device(checked_world, monkeypatch):
    """The plan's summed errors, its digest check, and the plan handed to a healing replica
    travel on the buckets' device. The measured errors are numbers read from the data
    (fake tensors hold none): a stand-in checks that the measurement runs on the device."""
    from commpress.compressors import host
    from commpress.layerwise import groups as layerwise

    def errors(order, shape, acc):
        assert acc.device == CUDA
        return [float(i) for i in range(len(order))]

    monkeypatch.setattr(layerwise, "tensor_errors", errors)
    monkeypatch.setattr(host, "numbers", lambda t: [0.0] * t.numel())  # every tensor to the first candidate
    config = Config.load({"method": "topk", "params": {"ratio": 0.1, "min_numel": 0}, "layerwise": {"enabled": True}})
    world = checked_world(2)
    models = [_model() for _ in range(2)]
    groups = [layerwise.LayerwiseGroups(config, m) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    buckets = [Bucket.from_tensors(0, [torch.randn(p.shape, device=CUDA) for p in m.parameters()], names) for m in models]
    world.run([g.composite.reduce(b, Context(rank=r, world_size=2, step=0)) for r, (g, b) in enumerate(zip(groups, buckets))])
    for g in groups:
        g.end_step(True)
    assert all(g.waiting for g in groups)
    world.run([g.planning(1, CUDA) for g in groups])
    assert all(g.plan is not None for g in groups)
    world.run([g.sharing(healing, CUDA) for g, healing in zip(groups, (False, True))])


def test_the_fsdp_wire_reaches_the_cuda_kernels(request):
    wire = Wire(Segments(64, ((0, 48),)), bits=8, bucket_size=16, dtype=torch.float32)
    x = torch.randn(64, device=CUDA)
    payload = torch.empty(wire.nbytes, dtype=torch.uint8, device=CUDA)
    wire.encode(x, seed=1, payload=payload)
    out = torch.empty(64, device=CUDA)
    wire.decode(payload, out)
    assert request.getfixturevalue("fake_cuda")["launches"], "no CuPy kernel was launched for CUDA tensors"
