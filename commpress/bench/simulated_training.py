"""Training steps of every method family on ranks simulated in one process (the quality suite's).

Every rank holds its own model and optimizer; :func:`run_ranks` computes each rank's
gradient of its own batch and hands the list to a step function that averages them with
the library's own parts on a :class:`~commpress.comm.SimulatedWorld`: the method groups a
``CommState`` would build (:func:`data_parallel`), one Local SGD, CO2 or DiLoCo trainer per
rank (:class:`OuterRanks`), and commpress's quantized FSDP2 collectives on FSDP2's layout
(:class:`QSDPRanks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from commpress.bench.fsdp_layout import flat_shards, plan_units, unshard
from commpress.bench.optimizers import set_lr
from commpress.comm import SimulatedWorld
from commpress.comm.averager import ParameterAverager
from commpress.compressors import EXACT, Bucket, Context, build
from commpress.compressors.wire.collectives import sum_rows
from commpress.config import Config
from commpress.config.tables import FSDPConfig
from commpress.fsdp.fsdp2 import Unit
from commpress.hooks.optimizer import hand_over_momentum
from commpress.layerwise.groups import LayerwiseGroups, method_groups
from commpress.local_sgd.config import trainer_for
from commpress.workloads.train import cosine_lr

__all__ = ["WORLD", "OuterRanks", "QSDPRanks", "copy_buffers_from_rank0", "data_parallel", "run_ranks"]

WORLD = 2


def run_ranks(
    task: Any,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    models: list,
    opts: list,
    step_fn: Callable[[int, list], None],
    lr: float,
    steps: int,
    broadcast_buffers: bool = True,
) -> None:
    """The training loop of the quality suite: every step, each rank's gradient of its own batch
    (after ``step_fn.gather(step)``, if it has one, set the weights to compute with, and, with
    ``broadcast_buffers``, :func:`copy_buffers_from_rank0` gave every rank rank 0's buffers), then
    ``step_fn(step, grads)``; ``step_fn.finish()`` at the end, if it has one."""
    schedule = cosine_lr(lr, steps)
    gather = getattr(step_fn, "gather", None)
    for step in range(steps):
        if gather is not None:
            gather(step)
        if broadcast_buffers:
            copy_buffers_from_rank0(models)
        grads = []
        for r, (model, opt) in enumerate(zip(models, opts)):
            set_lr(opt, schedule(step))
            x, y = task.batch(step, r, WORLD)
            grads.append(torch.autograd.grad(loss(model(x), y), list(model.parameters())))
        step_fn(step, grads)
    finish = getattr(step_fn, "finish", None)
    if finish is not None:
        finish()


def copy_buffers_from_rank0(models: Sequence[torch.nn.Module]) -> None:
    """Every rank's buffers (BatchNorm statistics and counts) set to rank 0's, as DDP built
    with ``broadcast_buffers=True`` (its default) broadcasts them before each forward,
    outside the comm hook."""
    with torch.no_grad():
        for model in models[1:]:
            for buffer, source in zip(model.buffers(), models[0].buffers()):
                buffer.copy_(source)


def _set_grads(model: torch.nn.Module, grads: Sequence[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.detach().clone().view_as(p)


def _apply(model: torch.nn.Module, opt: torch.optim.Optimizer, grads: Sequence[torch.Tensor]) -> None:
    _set_grads(model, grads)
    opt.step()


def data_parallel(cfg: Config, models: list, opts: list, sim: SimulatedWorld) -> Callable[[int, list], None]:
    """A step of data-parallel training: the ranks' gradients averaged by the config's
    method groups (plain averaging before ``start_iter``), as the DDP hook does; with
    ``[layerwise]``, a measured step's plan is made at the start of the next, as the hook
    makes it."""
    names = [n for n, _ in models[0].named_parameters()]
    groups = [method_groups(cfg, model) for model in models]
    for g, model, opt in zip(groups, models, opts):
        hand_over_momentum(opt, model.named_parameters(), lambda n, g=g: g.compressors[g.key_for(n)], cfg.start_iter)
    warmup = build(EXACT)

    def step_fn(step: int, grads: list) -> None:
        buckets = [Bucket.from_tensors(0, list(g), names) for g in grads]
        ctxs = [Context(rank=r, world_size=WORLD, step=step) for r in range(WORLD)]
        if step < cfg.start_iter:
            sim.run([warmup.reduce(b, c) for b, c in zip(buckets, ctxs)])
        else:
            planned = [(g, b) for g, b in zip(groups, buckets) if isinstance(g, LayerwiseGroups) and g.waiting]
            planning = [g.planning(step, b.buffer.device) for g, b in planned]
            if planning:
                sim.run(planning)
            sim.run([g.composite.reduce(b, c) for g, b, c in zip(groups, buckets, ctxs)])
        for g in groups:
            g.end_step(True)
        for model, opt, b in zip(models, opts, buckets):
            _apply(model, opt, b.views())

    return step_fn


class OuterRanks:
    """Local SGD, CO2 and DiLoCo on the simulated ranks: one trainer per rank, built as a
    ``[local_sgd]`` table builds it, averaging through its rank's backend. Every rank takes
    its step and starts the averages due (:meth:`~commpress.local_sgd.LocalSGD.local_step`)
    before any rank lands them (:meth:`~commpress.local_sgd.LocalSGD.apply_due`), so the
    ranks run one after another in one thread."""

    def __init__(self, cfg: Config, models: list, opts: list, sim: SimulatedWorld, steps: int) -> None:
        section = cfg.section("local_sgd")
        self.models = models
        self.trainers = [
            trainer_for(m, o, section, ParameterAverager(cfg.method, cfg.params, backend=b), steps)
            for m, o, b in zip(models, opts, sim.backends)
        ]

    def __call__(self, step: int, grads: list) -> None:
        for model, trainer, g in zip(self.models, self.trainers, grads):
            _set_grads(model, g)
            trainer.local_step()
        for trainer in self.trainers:
            trainer.apply_due()

    def finish(self) -> None:
        for trainer in self.trainers:
            trainer.start_due(final=True)
        for trainer in self.trainers:
            trainer.apply_due(final=True)


def _mean_in_rank_order(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    # the plain reduce-scatter with ReduceOp.AVG; bit-exact with gloo's for 2 ranks (a sum of
    # two is the same in either order, and halving is exact)
    return sum_rows(torch.stack(list(xs))).div_(len(xs))


class QSDPRanks:
    """QSDP, :func:`commpress.fsdp.apply` on FSDP2, on the simulated ranks, through the
    library's own units (:class:`~commpress.fsdp.fsdp2.Unit`), payloads
    (:class:`~commpress.fsdp.wire.Wire`) and seeds.

    Before each forward (:meth:`gather`) every rank's model gets what the quantized
    all-gather delivers: each rank's shard of the full-precision weights encoded with that
    rank's seed and decoded, its own shard included, so all ranks compute with the same
    weights (excluded parameters exact); the backward's re-gather uses the same seed, so the
    same weights. After backward each rank encodes every row of its flat gradient with the
    seed of (rank, row); rank ``r`` gets its row's payloads summed in rank order and divided
    by the world (:meth:`~commpress.fsdp.wire.Wire.accumulate`), the excluded gradients
    averaged exactly. The optimizers step on the full-precision weights with that average.
    The ranks' full-precision weights stay identical, so rank 0's give every rank's shard.

    Bytes per rank as the FSDP2 state counts them: one all-gather payload per gather (two a
    step, forward and backward, for all but the root's unit, which FSDP2 keeps gathered),
    ``world`` payloads and the excluded gradients per reduce-scatter.
    """

    def __init__(self, config: FSDPConfig, models: list, opts: list, sim: SimulatedWorld, units: Sequence[str]) -> None:
        self.models, self.opts, self.traffic = models, opts, sim.traffic
        self.units = plan_units(models[0], units, config, WORLD)
        self.masters: list[torch.Tensor] = []

    def _count(self, nbytes: int, collectives: int) -> None:
        for traffic in self.traffic:
            traffic.add(nbytes=nbytes, collectives=collectives)

    def gather(self, step: int) -> None:
        """Give every rank's model the weights the quantized all-gather delivers, seeded as
        in the library by each unit's count of reduce-scatters (``step`` here)."""
        self.masters = [p.detach().clone() for p in self.models[0].parameters()]
        weights: dict[int, torch.Tensor] = {}
        for unit, where, root in self.units:
            params = [self.masters[i] for i in where]
            shards = flat_shards(params, WORLD)
            wire = unit.wire("weights", shards.shape[1], shards.dtype)
            nbytes = shards[0].numel() * shards.element_size()
            if wire is not None:
                nbytes, payload = wire.nbytes, torch.empty(wire.nbytes, dtype=torch.uint8)
                for r in range(WORLD):
                    wire.encode(shards[r], unit.weight_seed(r), payload)
                    wire.decode(payload, shards[r])
            gathers = 1 if root else 2
            self._count(gathers * nbytes, gathers)
            weights.update(zip(where, unshard(shards, params)))
        self._load([weights[i] for i in range(len(self.masters))])

    def _load(self, weights: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for model in self.models:
                for p, w in zip(model.parameters(), weights):
                    p.copy_(w)

    def __call__(self, step: int, grads: list) -> None:
        self._load(self.masters)
        average: dict[int, torch.Tensor] = {}
        for unit, where, _ in self.units:
            rows = [flat_shards([g[i] for i in where], WORLD) for g in grads]  # each rank's reduce-scatter input
            average.update(zip(where, unshard(self._reduce_scatter(unit, rows), [self.masters[i] for i in where])))
        for model, opt in zip(self.models, self.opts):
            _apply(model, opt, [average[i] for i in range(len(self.masters))])

    def _reduce_scatter(self, unit: Unit, rows: list[torch.Tensor]) -> torch.Tensor:
        """``[WORLD, n]``: row ``r`` is what the reduce-scatter (``ReduceOp.AVG``) gives rank ``r``."""
        step, unit.steps = unit.steps, unit.steps + 1
        n, size = rows[0].shape[1], rows[0].element_size()
        wire = unit.wire("grads", n, rows[0].dtype)
        if wire is None:
            self._count(WORLD * n * size, 1)
            return _mean_in_rank_order(rows)
        out = rows[0].new_empty(WORLD, n)
        received = torch.empty(WORLD, WORLD, wire.nbytes, dtype=torch.uint8)  # [dest, src]: src's payload for dest
        for src in range(WORLD):
            for dest in range(WORLD):
                seed = unit.grad_seed(step, src, dest)
                wire.encode(rows[src][dest], seed, received[dest, src])
        for dest in range(WORLD):
            wire.accumulate(received[dest], out[dest], average=True)
        segments = wire.segments
        self._count(WORLD * wire.nbytes, 1)
        if segments.nraw:
            segments.put(out, _mean_in_rank_order([segments.take(r, "raw") for r in rows]), "raw")
            self._count(WORLD * segments.nraw * size, 1)
        return out
