"""A method added in one file, here: a toy compressor defined in this test alone goes through
the registry, ``commpress.register``'s DDP hook, layer-wise planning, Local SGD averaging and
the wire-bytes check, with no other file of the package knowing its name.

The toy sends the first ``keep`` of every tensor's entries of gradient + residual (one
all-reduce) and keeps the rest as its residual: a knob, error feedback, an exact error model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from test_compressor_wire import test_a_compressors_transfers_are_what_the_backend_counts as wire_bytes_check
from test_compressor_wire import test_transfers_are_the_sum_of_every_slots_own as slot_sum_check

import commpress
from commpress.bench.quality import train
from commpress.comm import SimulatedWorld
from commpress.compressors import (
    EXACT,
    AllReduce,
    Bucket,
    Compressor,
    Context,
    ParamSlot,
    Reduction,
    Setting,
    Transfer,
    available,
    build,
    register_compressor,
)
from commpress.compressors.tensor_stats import TensorStats
from commpress.config import Config, ConfigError
from commpress.layerwise.groups import LayerwiseGroups
from commpress.layerwise.measure import candidates
from commpress.layerwise.plan import label
from commpress.schema import Bounds

TOY = "test-toy-prefix"


@register_compressor
class PrefixCompressor(Compressor):
    """Sends each tensor's first ``ceil(keep n)`` entries of gradient + residual."""

    name: ClassVar[str] = TOY
    per_rank_state: ClassVar[tuple[str, ...]] = ("residuals",)
    knob: ClassVar[str | None] = "keep"

    def __init__(self, keep: Annotated[float, Bounds(gt=0, le=1)] = 0.5) -> None:  # registering checks it
        self.keep = keep
        self.residuals: dict[str, torch.Tensor] = {}
        self._staged: dict[str, torch.Tensor] = {}

    def count(self, numel: int) -> int:
        return math.ceil(self.keep * numel)

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        self.check_dtype(bucket)
        views = [bucket.buffer.narrow(0, s.offset, s.numel) for s in bucket.slots]
        accs = [v.float() + self.residuals.get(s.name, torch.zeros(s.numel)) for s, v in zip(bucket.slots, views)]
        wire = torch.cat([a[: self.count(a.numel())] for a in accs]).div_(ctx.world_size)
        summed = yield AllReduce(wire)
        at = 0
        for slot, view, acc in zip(bucket.slots, views, accs):
            k = self.count(slot.numel)
            view.zero_()[:k] = summed[at : at + k]
            at += k
            self._staged[slot.name] = torch.cat([torch.zeros(k), acc[k:]])

    def end_step(self, commit: bool) -> None:
        if commit:
            self.residuals.update(self._staged)
        self._staged = {}

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {n: t.clone() for n, t in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {n: t.reshape(-1).clone() for n, t in state["residuals"].items()}

    def slot_transfers(self, slot: ParamSlot, element_size: int) -> tuple[Transfer, ...]:
        return (Transfer("all_reduce", 4 * self.count(slot.numel)),)

    def params_for_ratio(self, ratio: float, slots: Sequence[ParamSlot]) -> dict[str, Any]:
        return {"keep": ratio}

    def ladder(self, params: Mapping[str, Any]) -> list[Setting]:
        return [(TOY, dict(params)), (TOY, {**params, "keep": self.keep / 2}), (EXACT, {})]

    def error_model(self, tensor: TensorStats) -> Callable[[], float]:
        return lambda: float(tensor.whole[self.count(tensor.numel) :].double().square().sum())

    def owed(self, entries: Mapping[str, Any]) -> torch.Tensor | None:
        return entries.get("residuals")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def test_the_registry_builds_it_and_checks_its_parameters():
    assert TOY in available() and isinstance(build(TOY, {"keep": 0.25}), PrefixCompressor)
    with pytest.raises(ConfigError, match=r"keep = 2.0 is not accepted; expected a number in \(0, 1\]"):
        build(TOY, {"keep": 2.0})
    with pytest.raises(ConfigError, match=rf"method '{TOY}': keep = 0.0 is not accepted; expected a number in \(0, 1\]"):
        PrefixCompressor(0)  # built directly: the same declared check
    with pytest.raises(ConfigError, match=r"unknown key 'ratio'"):
        build(TOY, {"ratio": 0.1})


@pytest.mark.parametrize("params", [{}, {"keep": 0.1}])
def test_its_wire_bytes_are_what_the_backend_counts(params):
    wire_bytes_check(TOY, params, torch.float32)
    slot_sum_check(TOY, params)


@pytest.fixture
def one_rank():
    """A gloo process group of this process alone."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_register_puts_it_on_the_ddp_hook(one_rank):
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reg = commpress.register(model, {"method": TOY, "params": {"keep": 0.25}}, optimizer=opt)
    x = torch.randn(4, 16)
    local = torch.autograd.grad(model.module(x).square().sum(), list(model.parameters()))
    model(x).square().sum().backward()
    for g, p in zip(local, model.parameters()):
        k = math.ceil(0.25 * g.numel())
        assert torch.equal(p.grad.reshape(-1)[:k], g.reshape(-1)[:k]) and not p.grad.reshape(-1)[k:].any()
    assert reg.traffic.bytes_sent == sum(4 * math.ceil(0.25 * p.numel()) for p in model.parameters())


def test_layerwise_plans_its_tensors_with_its_ladder_and_error_model():
    model = _model()
    config = Config.load({"method": TOY, "params": {"keep": 0.5}, "layerwise": {"enabled": True, "every": 1000}})
    groups = [LayerwiseGroups(config, model) for _ in range(2)]
    assert [label(s) for s in groups[0].candidates.values()] == [f"{TOY} keep=0.5", f"{TOY} keep=0.25", EXACT]
    assert candidates(TOY, {"keep": 0.5}) == list(groups[0].candidates.values())
    names, shapes = [n for n, _ in model.named_parameters()], [p.shape for p in model.parameters()]
    sim, rng = SimulatedWorld(2), torch.Generator().manual_seed(0)
    grads = [[torch.randn(s, generator=rng) for s in shapes] for _ in groups]
    buckets = [Bucket.from_tensors(0, g, names) for g in grads]
    sim.run([g.composite.reduce(b, Context(r, 2, 0)) for r, (g, b) in enumerate(zip(groups, buckets))])
    for g in groups:
        g.end_step(True)
    for name, t in zip(names, grads[0]):  # the main setting's measured error: its own residual's energy
        k = math.ceil(0.5 * t.numel())
        assert math.isclose(groups[0]._measured[name].errors[0], float(t.reshape(-1)[k:].double().square().sum()))
    sim.run([g.planning(1, torch.device("cpu")) for g in groups])
    plans = [g.plan for g in groups]
    assert plans[0] is not None and plans[0].to_dict() == plans[1].to_dict()
    assert plans[0].total_bytes <= plans[0].budget == sum(4 * math.ceil(0.5 * math.prod(s)) for s in shapes)
    assert set(plans[0].labels.values()) <= {f"{TOY} keep=0.5", f"{TOY} keep=0.25", EXACT}
    assert len(set(plans[0].labels.values())) > 1  # the plan mixes settings: every tensor at the configured one costs as much


def test_local_sgd_averages_through_it():
    config = {"method": TOY, "params": {"keep": 1.0}, "local_sgd": {"period": 2}}
    run = train("shapes", "sgd", TOY, 0, 4, config=config)  # raises if the ranks end with different models
    exact = train("shapes", "sgd", "exact", 0, 4, config={**config, "method": EXACT, "params": {}})
    assert run.error is None and run.eval_loss == exact.eval_loss  # keep = 1 sends everything: the exact average
    half = train("shapes", "sgd", TOY, 0, 4, config={**config, "params": {"keep": 0.5}})
    assert math.isfinite(half.eval_loss) and half.eval_loss != exact.eval_loss
    assert half.bytes_per_step == pytest.approx(exact.bytes_per_step / 2, rel=1e-3)
