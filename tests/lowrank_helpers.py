"""Shared pieces of the low-rank tests: a bucket layout that exercises every code path, a
simulated-world driver, and a per-matrix reference implementation written from the papers."""

from __future__ import annotations

import pytest
import torch

from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build
from commpress.compressors.lowrank_plan import LowRankPlan

# (12, 10) matrices at unequal spacing (two strided runs), a conv weight (8 x 12 as a matrix),
# 1-D tensors, a matrix too small to compress (2 x 2) and a lone (20, 6): every path of the plan.
SHAPES = [(12, 10), (12,), (12, 10), (12,), (8, 3, 2, 2), (12, 10), (3,), (12, 10), (2, 2), (20, 6)]
NAMES = [f"t{i}" for i in range(len(SHAPES))]


def grads(world: int, seed: int, shapes=SHAPES, dtype=torch.float32) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(world)]


def buckets(tensors: list[list[torch.Tensor]], index: int = 0, names=NAMES) -> list[Bucket]:
    return [Bucket.from_tensors(index, ts, names[: len(ts)]) for ts in tensors]


def reduce_step(sim: SimulatedWorld, comps, bs: list[Bucket], step: int = 0, commit: bool = True) -> None:
    """One training step of one bucket per rank: reduce, then end the step on every rank."""
    sim.reduce(comps, bs, step)
    for c in comps:
        c.end_step(commit)


def run(method: str, params: dict, world: int, steps: int, seed: int = 0, comps=None):
    """``steps`` steps of fresh random gradients; returns (compressors, last buckets, world)."""
    sim = SimulatedWorld(world)
    comps = comps or sim.compressors(lambda: build(method, params))
    out = None
    for step in range(steps):
        out = buckets(grads(world, seed * 1000 + step))
        reduce_step(sim, comps, out, step)
    return comps, out, sim


def error_of(comp, bucket: Bucket) -> torch.Tensor:
    """The committed error of ``bucket``'s parameters, laid out like the bucket (zeros where
    a parameter holds none: the dense ones)."""
    saved = comp.state_dict()["error"]
    out = torch.zeros(bucket.buffer.numel())
    for s in bucket.slots:
        if s.name in saved:
            assert saved[s.name].shape == s.shape and saved[s.name].device.type == "cpu"
            out[s.offset : s.offset + s.numel] = saved[s.name].reshape(-1)
    return out


def seeded_state(comps, bucket: Bucket, rank: int, seed: int = 7) -> list[dict]:
    """Load a known state into every rank's compressor: a random error per rank (errors
    differ across ranks), random q and p factors shared by all. Returns the loaded states
    as flat tensors laid out like the bucket (error) and the plan's factor buffers (q, p)."""
    plan = LowRankPlan.build(tuple(bucket.slots), rank, 2.0)
    g = torch.Generator().manual_seed(seed)
    q, p = torch.randn(plan.q_numel, generator=g), torch.randn(plan.p_numel, generator=g)
    states = []
    for comp in comps:
        error = torch.randn(bucket.buffer.numel(), generator=g)
        error[plan.dense_index] = 0
        saved = {"error": {}, "q": {}, "p": {}}
        for f in plan.factors:
            name = f.slot.name
            saved["error"][name] = error[f.slot.offset : f.slot.offset + f.slot.numel].view(f.slot.shape).clone()
            saved["q"][name] = q[f.q_offset : f.q_offset + f.rank * f.m].view(f.rank, f.m).clone()
            saved["p"][name] = p[f.p_offset : f.p_offset + f.n * f.rank].view(f.n, f.rank).clone()
        comp.load_state_dict(saved)
        states.append({"error": error, "q": q.clone(), "p": p.clone()})
    return states


def factor_blocks(plan: LowRankPlan, flat: torch.Tensor, which: str) -> dict[int, torch.Tensor]:
    """offset of each compressed matrix -> its block of ``flat`` (q: r x m transposed Q, p: n x r)."""
    views = plan.qt_views(flat) if which == "q" else plan.p_views(flat)
    return {b.first + k * b.stride: views[i][k] for i, b in enumerate(plan.batches) for k in range(b.count)}


def reference(kind: str, bucket_grads: list[Bucket], states: list[dict], rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One step of ``kind`` ("powersgd", "acp_p" or "acp_q") matrix by matrix, in float64:
    returns the averaged buffer and every rank's new error."""
    world = len(bucket_grads)
    plan = LowRankPlan.build(tuple(bucket_grads[0].slots), rank, 2.0)
    qs = factor_blocks(plan, states[0]["q"], "q")
    ps = factor_blocks(plan, states[0]["p"], "p")
    result = torch.stack([b.buffer.double() for b in bucket_grads]).mean(0)
    errors = [torch.zeros_like(result) for _ in range(world)]
    compressed = {f.slot.offset for f in plan.factors}
    for s in bucket_grads[0].slots:
        if s.offset not in compressed:  # a dense tensor
            continue
        n = s.shape[0]
        sl = slice(s.offset, s.offset + s.numel)
        ms = [(b.buffer[sl].double() + st["error"][sl].double()).view(n, -1) for b, st in zip(bucket_grads, states)]
        if kind == "powersgd":
            p_hat = torch.linalg.qr(sum(m @ torch.linalg.qr(qs[s.offset].double().T).Q for m in ms)).Q
            r = p_hat @ (sum(m.T @ p_hat for m in ms) / world).T
        elif kind == "acp_p":
            q_hat = torch.linalg.qr(qs[s.offset].double().T).Q
            r = (sum(m @ q_hat for m in ms) / world) @ q_hat.T
        else:
            p_hat = torch.linalg.qr(ps[s.offset].double()).Q
            r = p_hat @ (sum(m.T @ p_hat for m in ms) / world).T
        result[sl] = r.reshape(-1)
        for e, m in zip(errors, ms):
            e[sl] = (m - r).reshape(-1)
    return result, errors


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny batched LAPACK calls (QR) pay OpenMP start-up on every call when the machine is
    busy; these tests use small matrices, so one thread is also the fast choice."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
