"""The host reads of a DDP step, counted, so a change that adds one fails here.

On a GPU every value read back to the host waits for the device: the launches queued
before it drain, and the host stops queueing work. Each bucket's path therefore reads
nothing but what it must, through :mod:`commpress.compressors.host` (flags a step
branches on, numbers its sizes rest on) and the hook state's one read per step
(``hooks.state.step_was_finite``). Run on fake CUDA buckets (``test_fake_cuda.py``'s
fixture), any other read raises, since fake tensors hold no data; the seams are counted
here. ``READS`` is what each method reads today, per rank and step of two buckets: the
step's finiteness flag, plus one or two flags per bucket for the methods that branch on
their received values (docs/kernels.md, "Host reads per step": the aim is the one read per
step). Lowering a count is progress (update the table); raising one is a host read added
to the bucket's path.
"""

from __future__ import annotations

import pytest
import torch
from test_fake_cuda import CUDA, fake_cuda  # noqa: F401  (the fixture)

from commpress import CommState
from commpress.comm import SimulatedWorld
from commpress.compressors import host

WORLD, STEPS = 2, 4
#: method -> host reads per rank and step (two buckets), after the first step
READS = {
    "none": 1,
    "fp16": 1,
    "bf16": 1,
    "powersgd": 3,  # P's flag read with Q's, after the second all-reduce
    "acpsgd": 3,
    "terngrad": 1,  # its check stays on the device (NaN where a scale is not finite) for the step's flag
    "quant": 3,
    "onebit": 3,
    "topk": 5,
}


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64, device=CUDA), torch.nn.LayerNorm(64, device=CUDA), torch.nn.Linear(64, 32, device=CUDA)
    )


@pytest.mark.usefixtures("fake_cuda")
@pytest.mark.parametrize("method", sorted(READS))
def test_a_step_reads_the_host_no_more_than_it_did(monkeypatch, method):
    reads: list[str] = []

    def counted(kind, answer):
        def read(t):
            reads.append(kind)
            return answer(t)

        return read

    monkeypatch.setattr(host, "flags", counted("flags", lambda t: [True] * t.numel()))
    monkeypatch.setattr(host, "numbers", counted("numbers", lambda t: [0.0] * t.numel()))
    monkeypatch.setattr("commpress.hooks.state.step_was_finite", counted("step", lambda flags: True))
    world = SimulatedWorld(WORLD)
    models = [_model() for _ in range(WORLD)]
    params = {"powersgd": {"rank": 2}, "acpsgd": {"rank": 2}, "topk": {"min_numel": 0}}.get(method, {})
    states = [CommState({"method": method, "params": params}, model=m, backend=b) for m, b in zip(models, world.backends)]
    per_step = []
    for _ in range(STEPS):
        before, futures = len(reads), []
        for state, model in zip(states, models):
            ps = list(model.parameters())
            for index, members in enumerate([ps[3:], ps[:3]]):  # DDP's order: last layer first
                buffer = torch.cat([torch.randn(p.shape, device=CUDA).reshape(-1) for p in members])
                futures.append(state.reduce(index, buffer, members, advance=index == 1))
        assert all(f.done() and f.value().device == CUDA for f in futures)  # a read off the seams raises in value()
        per_step.append((len(reads) - before) / WORLD)
    assert per_step[1:] == [READS[method]] * (STEPS - 1), (per_step, reads[-READS[method] :])
