"""Dion in place of Muon's step: the power iteration over ranks against the paper's formulas
(two simulated ranks, float64 reference), and ``register(ddp, {"dion": ...},
optimizer=[muon, adamw])`` on 2 gloo ranks: the ranks stay identical, Muon's own step
never runs, the factors are all that travels for the matrices, a resumed run continues
bit for bit, and what cannot run is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from commpress.bench.launch import run_local
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket
from commpress.compressors.dion import COLUMN_EPS, DionCompressor
from commpress.config import Config
from commpress.errors import ConfigError
from commpress.optim.dion import muon_lr_scale

SHAPES = [(12, 8), (12, 8), (6, 10)]  # a batch of two same-shape matrices and one other
NAMES = ["a", "b", "c"]
RANK, MU, WORLD = 3, 0.9, 2


def _reference_step(ms, grads, q, mu):
    """Dion over data-parallel ranks as the issue and the paper write it, in float64: each
    rank's B = M + G; P = orth(mean B Q); R = mean B^T P; M = B - (1 - mu) P R^T;
    Q = R with unit columns; the direction P Q^T."""
    bs = [m + g for m, g in zip(ms, grads)]
    p = torch.linalg.qr(sum(b @ q for b in bs) / len(bs)).Q
    r = sum(b.T @ p for b in bs) / len(bs)
    ms = [b - (1 - mu) * p @ r.T for b in bs]
    q = r / (r.norm(dim=0, keepdim=True) + COLUMN_EPS)
    return ms, q, p @ q.T


def test_the_power_iteration_follows_dions_formulas():
    g = torch.Generator().manual_seed(0)
    world = SimulatedWorld(WORLD)
    comps = world.compressors(lambda: DionCompressor(rank=RANK, mu=MU))
    q0 = {n: torch.randn(s[1], RANK, generator=g, dtype=torch.float64) for n, s in zip(NAMES, SHAPES)}
    for c in comps:  # a shared warm start both sides know
        c.load_state_dict({"error": {}, "p": {}, "q": {n: q.T.float() for n, q in q0.items()}})
    ref_m = {n: [torch.zeros(s, dtype=torch.float64)] * WORLD for n, s in zip(NAMES, SHAPES)}
    ref_q = dict(q0)
    for step in range(4):
        grads = [[torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES] for _ in range(WORLD)]
        buckets = [Bucket.from_tensors(0, [t.float() for t in gs], NAMES) for gs in grads]
        assert all(world.reduce(comps, buckets, step=step))
        for c in comps:
            c.end_step(True)
        for i, n in enumerate(NAMES):
            ref_m[n], ref_q[n], direction = _reference_step(ref_m[n], [gs[i] for gs in grads], ref_q[n], MU)
            for r in range(WORLD):
                got = buckets[r].views()[i].double()
                torch.testing.assert_close(got, direction, atol=2e-5, rtol=1e-4, msg=f"{n} step {step} rank {r}")
                torch.testing.assert_close(comps[r].state_dict()["error"][n].double(), ref_m[n][r], atol=2e-4, rtol=1e-4)


def test_a_fractional_rank_is_that_share_of_each_matrixs_smaller_side():
    world = SimulatedWorld(WORLD)
    comps = world.compressors(lambda: DionCompressor(rank=0.5, mu=MU))
    g = torch.Generator().manual_seed(1)
    buckets = [Bucket.from_tensors(0, [torch.randn(s, generator=g) for s in SHAPES], NAMES) for _ in range(WORLD)]
    assert all(world.reduce(comps, buckets, step=0))
    comps[0].end_step(True)
    ranks = {n: q.shape[0] for n, q in comps[0].state_dict()["q"].items()}
    assert ranks == {"a": 4, "b": 4, "c": 3}  # half of min(12, 8) and of min(6, 10)
    assert [comps[0].factor_numels(s) for s in buckets[0].slots] == [(48, 32), (48, 32), (18, 30)]
    with pytest.raises(ConfigError, match=r"\[dion\]: rank = 1.0 .*a number in \(0, 1\)"):
        Config.load({"dion": {"rank": 1.0}})


def test_a_vector_is_refused():
    bucket = Bucket.from_tensors(0, [torch.randn(4, 3), torch.randn(5)], ["w", "bias"])
    with pytest.raises(ValueError, match=r"\[dion\] steps 2-D matrices; bias is not one"):
        SimulatedWorld(1).reduce([DionCompressor()], [bucket])


def test_the_lr_scale_is_muons():
    """Dion steps with the factor torch's Muon multiplies its lr by (its private rule, which
    this copy must follow)."""
    from torch.optim._muon import _adjust_lr

    for fn in (None, "original", "match_rms_adamw", "none"):
        for shape in ((8, 2), (2, 8), (16, 16)):
            assert muon_lr_scale(fn, shape) == pytest.approx(_adjust_lr(1.0, fn, torch.Size(shape)))


STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 3))


def _optimizers(module: nn.Module) -> list[torch.optim.Optimizer]:
    hidden = [module[2].weight, module[4].weight]
    rest = [p for p in module.parameters() if all(p is not h for h in hidden)]
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1), torch.optim.AdamW(rest, lr=0.01)]


def _train(ddp, opts, start, steps, rank):
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        for o in opts:
            o.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        for o in opts:
            o.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commpress
    from commpress.errors import ConfigError

    cfg = {"method": "none", "dion": {"rank": 2}}
    out: dict = {}
    ddp = DistributedDataParallel(_model())
    opts = _optimizers(ddp.module)
    start = _flat(ddp).clone()
    reg = commpress.register(ddp, cfg, optimizer=opts)
    traffic = reg.traffic  # counts on, as the race reads it
    _train(ddp, opts, 0, STEPS, rank)
    every = [torch.empty_like(_flat(ddp)) for _ in range(world)]
    dist.all_gather(every, _flat(ddp))
    out["same"] = all(torch.equal(t, every[0]) for t in every)
    out["moved"] = not torch.equal(_flat(ddp), start)
    out["muon_state"] = len(opts[0].state)  # Muon's own step never ran: no momentum buffer
    out["bytes"] = traffic.bytes_sent
    out["steps"] = reg.dion.steps
    # a resumed run continues bit for bit: 3 steps, a checkpoint, 3 more in a new job
    ddp = DistributedDataParallel(_model())
    opts = _optimizers(ddp.module)
    reg = commpress.register(ddp, cfg, optimizer=opts)
    _train(ddp, opts, 0, 3, rank)
    saved = copy.deepcopy((ddp.module.state_dict(), [o.state_dict() for o in opts], reg.state_dict()))
    whole = reg.state_dict(full=True)
    reg.remove()
    ddp = DistributedDataParallel(_model())
    opts = _optimizers(ddp.module)
    reg = commpress.register(ddp, cfg, optimizer=opts)
    ddp.module.load_state_dict(saved[0])
    for o, s in zip(opts, saved[1]):
        o.load_state_dict(s)
    reg.load_state_dict(saved[2] if rank == 0 else whole)  # a rank's own part, or its part of the whole job
    _train(ddp, opts, 3, STEPS - 3, rank)
    out["resumed"] = torch.equal(_flat(ddp), every[0])
    reg.remove()  # Muon's own step again
    _train(ddp, opts, STEPS, 1, rank)
    out["muon_state_after_remove"] = len(opts[0].state)
    # refusals
    two_momenta = [{"params": [ddp.module[2].weight], "momentum": 0.9}, {"params": [ddp.module[4].weight], "momentum": 0.95}]
    for name, given in (
        ("adamw", [torch.optim.AdamW(ddp.parameters())]),
        ("start_iter", None),
        ("momenta", [torch.optim.Muon(two_momenta), torch.optim.AdamW(ddp.module[0].parameters())]),
    ):
        try:
            fresh = DistributedDataParallel(_model())
            spec = cfg if given is not None else {**cfg, "start_iter": 2}
            commpress.register(fresh if name != "momenta" else ddp, spec, optimizer=given or _optimizers(fresh.module))
            out[name] = None
        except (ConfigError, TypeError) as exc:
            out[name] = str(exc)
    return out


@pytest.mark.multiproc
def test_register_steps_muons_matrices_with_dion_on_two_ranks():
    results = run_local(_ranks, 2)
    # per step: the two 16 x 16 matrices' factors at rank 2 ((16 + 16) * 2 numbers each), one
    # flag per bucket holding them, and the other 195 gradient numbers, float32
    factors = 2 * (16 + 16) * 2 * 4
    for r in results:
        assert r["same"] and r["moved"] and r["resumed"]
        assert r["muon_state"] == 0 and r["muon_state_after_remove"] == 2
        assert r["steps"] == STEPS
        assert r["bytes"] == (factors + 4 + 4 * 195) * STEPS, r["bytes"]
        assert "[dion] takes over the step of one torch.optim.Muon; got 0 among: AdamW over 8 parameters" in r["adamw"]
        assert "start_iter" in r["start_iter"] and "[dion]" in r["start_iter"]
        assert "[dion]: Muon's param groups have momentum 0.9, 0.95; Dion takes one mu" in r["momenta"]
