"""1-bit Adam on the quality suite's simulated ranks: one
:class:`~commpress.optim.OneBitAdam` per rank, as an ``[onebit_adam]`` table builds it,
its momentum averaged through its rank's backend; during the warm-up the gradients are
averaged exactly, as its DDP comm hook does."""

from __future__ import annotations

from commpress.bench.simulated_training import WORLD, _set_grads
from commpress.comm import SimulatedWorld
from commpress.comm.averager import ParameterAverager
from commpress.compressors import EXACT, Bucket, Context, build
from commpress.config import Config
from commpress.optim import AtTheStep, OneBitAdam

__all__ = ["OneBitAdamRanks"]


class OneBitAdamRanks:
    """The step function of the rows with an ``[onebit_adam]`` table (see
    :func:`commpress.bench.simulated_training.run_ranks`)."""

    def __init__(self, cfg: Config, models: list, opts: list, sim: SimulatedWorld, steps: int) -> None:
        warmup = cfg.section("onebit_adam").warmup_steps(steps)
        self.models, self.opts, self.sim = models, opts, sim
        self.names = [n for n, _ in models[0].named_parameters()]
        self.exact = build(EXACT)
        self.ranks = [
            OneBitAdam(opt, model.named_parameters(), AtTheStep(ParameterAverager(cfg.method, cfg.params, backend=b)), warmup)
            for model, opt, b in zip(models, opts, sim.backends)
        ]

    def __call__(self, step: int, grads: list) -> None:
        if self.ranks[0].frozen:  # local gradients; every rank starts its momentum average, then applies it
            for model, g in zip(self.models, grads):
                _set_grads(model, g)
            started = [r.start_step() for r in self.ranks]
            for r, fut in zip(self.ranks, started):
                r.finish_step(fut)
        else:
            buckets = [Bucket.from_tensors(0, list(g), self.names) for g in grads]
            self.sim.run([self.exact.reduce(b, Context(rank=r, world_size=WORLD, step=step)) for r, b in enumerate(buckets)])
            for model, opt, b in zip(self.models, self.opts, buckets):
                _set_grads(model, b.views())
                opt.step()
        for r in self.ranks:
            r.average.stepped()
