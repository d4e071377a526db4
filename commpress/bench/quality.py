"""Training quality of every method on small tasks, in one process.

Each run trains one task with one optimizer and one method on ranks simulated by
:class:`commpress.comm.SimulatedWorld`: every rank holds its own model and optimizer,
computes the gradient of its own batch, and the real compressors (the method groups a
``CommState`` would build, ``start_iter`` included) average them, with every compressor's
``end_step(True)`` after each step; Local SGD rows average the ranks' models through the
real :class:`~commpress.local_sgd.ParameterAverager` at the rounds its period policy sets,
CO2 rows run the real :class:`~commpress.local_sgd.CO2`, one per rank, and QSDP rows (an
``[fsdp]`` table) compute with the weights commpress's quantized FSDP2 all-gather delivers
and step on the average its quantized reduce-scatter computes (:class:`_QSDP`).
The result is the held-out loss at the end, compared with ``none`` on the same task,
optimizer and seed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, Context, build
from commpress.config import Config, parse_method_spec
from commpress.config.groups import MethodGroups
from commpress.config.tables import FSDPConfig
from commpress.errors import ConfigError
from commpress.fsdp.config import load_fsdp_config
from commpress.fsdp.fsdp2 import ParamShard, Unit
from commpress.hooks.optimizer import hand_over_momentum
from commpress.local_sgd import ParameterAverager
from commpress.local_sgd.config import period_policy, trainer_for
from commpress.local_sgd.flat import FlatModel
from commpress.local_sgd.rounds import RoundClock
from commpress.terminal import format_table
from commpress.workloads.charlm import CharTask
from commpress.workloads.synthetic import CharTransformerTask, ShapesTask
from commpress.workloads.train import cosine_lr

__all__ = ["METHODS", "OPTIMIZERS", "TASKS", "QualityRun", "Summary", "method_config", "render", "run_suite", "summarize"]

WORLD = 2


@dataclass(frozen=True)
class TaskSpec:
    """A task: ``make(seed)`` gives an object with ``model()``, ``batch(step, rank, world)``
    and ``eval_batch()``; ``loss(output, target)``; base learning rates by optimizer;
    ``units``: the submodules an FSDP2 run ``fully_shard``-s before the root (the QSDP rows)."""

    make: Callable[[int], Any]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    lr: dict[str, float]
    units: tuple[str, ...] = ()


TASKS: dict[str, TaskSpec] = {
    # the demo: character MLP, batch 64 per rank, SGD lr 0.2; the other base learning rates
    # are the better of two tried for ``none`` at 200 steps (a factor 3 apart). FSDP units:
    # each layer with weights (as ``commpress bench-fsdp`` shards the demo), the transformer's
    # blocks (its root reads the position embedding's weight directly, so the root keeps it)
    "charlm": TaskSpec(
        lambda seed: CharTask(batch_size=64, seed=seed),
        F.cross_entropy,
        {"sgd": 0.2, "adamw": 6e-3},
        ("embed", "body.0", "body.2", "body.4"),
    ),
    "shapes": TaskSpec(
        lambda seed: ShapesTask(seed=seed),
        ShapesTask.loss,
        {"sgd": 0.05, "adamw": 2e-3},
        ("features.0", "features.3", "head.0", "head.2"),
    ),
    "transformer": TaskSpec(
        lambda seed: CharTransformerTask(seed=seed),
        CharTransformerTask.loss,
        {"sgd": 0.3, "adamw": 1e-2},
        ("body.layers.0", "body.layers.1"),
    ),
}
#: Optimizers by name: SGD with momentum 0.9 and AdamW (weight decay 0.01), each under a
#: cosine schedule from the task's base learning rate.
OPTIMIZERS = ("sgd", "adamw")
#: Method rows by label, in table order.
METHODS = (
    "none",
    "fp16",
    "bf16",
    "powersgd",
    "acpsgd",
    "terngrad",
    "terngrad-last",
    "topk",
    "topk-dgc",
    "local-sgd+qsr",
    "co2",
    "qsdp-w8g8",
)


def method_config(label: str, lr: float, steps: int) -> dict[str, Any]:
    """The commpress config of row ``label`` for a run of ``steps`` from base learning
    rate ``lr``; a label that is no row is read as a method spec (``"topk:ratio=0.03"``).

    As in the demo, the low-rank rows start after 10% plain steps; QSR's alpha is the
    base learning rate (H = max(4, (lr0 / lr)^2): 4 steps at first, longer as lr decays);
    ``terngrad-last`` sends the last layer in full precision; ``co2`` is the demo's CO2
    (period 5, outer learning rate 0.7, averaging in bf16); ``qsdp-w8g8`` is FSDP2 with
    commpress's ``[fsdp]`` table: 8-bit weights and gradients, the table's other defaults.
    """
    rows: dict[str, dict[str, Any]] = {
        "none": {"method": "none"},
        "fp16": {"method": "fp16"},
        "bf16": {"method": "bf16"},
        "powersgd": {"method": "powersgd", "start_iter": steps // 10, "params": {"rank": 4}},
        "acpsgd": {"method": "acpsgd", "start_iter": steps // 10, "params": {"rank": 4}},
        "terngrad": {"method": "terngrad"},
        "terngrad-last": {"method": "terngrad", "params": {"skip_last_layer": True}},
        "topk": {"method": "topk", "params": {"ratio": 0.01}},
        "topk-dgc": {"method": "topk", "params": {"ratio": 0.01, "dgc": True}},
        "local-sgd+qsr": {"method": "none", "local_sgd": {"period": 4, "qsr_alpha": lr}},
        "co2": {"method": "bf16", "local_sgd": {"algorithm": "co2", "period": 5, "outer_lr": 0.7}},
        "qsdp-w8g8": {"method": "none", "fsdp": {"weight_bits": 8, "grad_bits": 8}},
    }
    if label in rows:
        return rows[label]
    try:
        spec = parse_method_spec(label)
        Config.load(spec)
    except ConfigError as exc:
        raise ConfigError(f"method {label!r} is neither a row ({', '.join(METHODS)}) nor a valid method spec: {exc}") from None
    return spec


@dataclass(frozen=True)
class QualityRun:
    """One training run's outcome; ``error`` (a ConfigError's message) when the method
    cannot run with this optimizer, then ``eval_loss`` is NaN."""

    task: str
    optimizer: str
    method: str
    seed: int
    eval_loss: float
    bytes_per_step: float
    error: str | None = None


def _optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def train(
    task_name: str, optimizer: str, method: str, seed: int, steps: int, config: Mapping[str, Any] | None = None
) -> QualityRun:
    """Train ``task_name`` for ``steps`` on 2 simulated ranks; the held-out loss at the end.
    ``config``: a commpress config to run under the label ``method`` instead of the row's."""
    if task_name not in TASKS:
        raise ConfigError(f"task = {task_name!r} is not accepted; accepted: {', '.join(TASKS)}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer = {optimizer!r} is not accepted; accepted: {', '.join(OPTIMIZERS)}")
    spec = TASKS[task_name]
    task, base_lr = spec.make(seed), spec.lr[optimizer]
    cfg = Config.load(config if config is not None else method_config(method, base_lr, steps))
    models = [task.model() for _ in range(WORLD)]
    opts = [_optimizer(optimizer, m.parameters(), base_lr) for m in models]
    sim = SimulatedWorld(WORLD)
    local = cfg.section("local_sgd")
    try:
        if cfg.section("fsdp") is not None:
            step_fn = _QSDP(load_fsdp_config(cfg), models, opts, sim, spec.units)
        elif local is None:
            step_fn = _data_parallel(cfg, models, opts, sim)
        elif local.algorithm == "co2":
            step_fn = _CO2(cfg, models, opts, sim, steps)
        else:
            step_fn = _LocalSGD(cfg, models, opts, sim, steps)
    except ConfigError as exc:
        return QualityRun(task_name, optimizer, method, seed, math.nan, math.nan, str(exc))
    _run_ranks(task, spec.loss, models, opts, step_fn, base_lr, steps)
    flats = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
    if not all(torch.equal(flats[0], f) for f in flats[1:]) and not flats[0].isnan().any():
        raise RuntimeError(f"{method}: the simulated ranks ended with different models")
    x, y = task.eval_batch()
    with torch.no_grad():
        eval_loss = spec.loss(models[0](x), y).item()
    return QualityRun(task_name, optimizer, method, seed, eval_loss, sim.traffic[0].bytes_sent / steps)


def _run_ranks(
    task: Any,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    models: list,
    opts: list,
    step_fn: Callable[[int, list], None],
    lr: float,
    steps: int,
) -> None:
    """The training loop of :func:`train`: every step, each rank's gradient of its own batch
    (after ``step_fn.gather(step)``, if it has one, set the weights to compute with), then
    ``step_fn(step, grads)``; ``step_fn.finish()`` at the end, if it has one."""
    schedule = cosine_lr(lr, steps)
    gather = getattr(step_fn, "gather", None)
    for step in range(steps):
        if gather is not None:
            gather(step)
        grads = []
        for r, (model, opt) in enumerate(zip(models, opts)):
            for group in opt.param_groups:
                group["lr"] = schedule(step)
            x, y = task.batch(step, r, WORLD)
            grads.append(torch.autograd.grad(loss(model(x), y), list(model.parameters())))
        step_fn(step, grads)
    finish = getattr(step_fn, "finish", None)
    if finish is not None:
        finish()


def _set_grads(model: torch.nn.Module, grads: Sequence[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.detach().clone().view_as(p)


def _apply(model: torch.nn.Module, opt: torch.optim.Optimizer, grads: Sequence[torch.Tensor]) -> None:
    _set_grads(model, grads)
    opt.step()


def _data_parallel(cfg: Config, models: list, opts: list, sim: SimulatedWorld) -> Callable[[int, list], None]:
    """A step of data-parallel training: the ranks' gradients averaged by the config's
    method groups (plain averaging before ``start_iter``), as the DDP hook does."""
    names = [n for n, _ in models[0].named_parameters()]
    groups = [MethodGroups(cfg, model) for model in models]
    for g, model, opt in zip(groups, models, opts):
        hand_over_momentum(opt, model.named_parameters(), lambda n, g=g: g.compressors[g.key_for(n)], cfg.start_iter)
    warmup = build("none")

    def step_fn(step: int, grads: list) -> None:
        buckets = [Bucket.from_tensors(0, list(g), names) for g in grads]
        ctxs = [Context(rank=r, world_size=WORLD, step=step) for r in range(WORLD)]
        if step < cfg.start_iter:
            sim.run([warmup.reduce(b, c) for b, c in zip(buckets, ctxs)])
        else:
            sim.run([g.reduction(b, c) for g, b, c in zip(groups, buckets, ctxs)])
        for g in groups:
            g.end_step(True)
        for model, opt, b in zip(models, opts, buckets):
            _apply(model, opt, b.views())

    return step_fn


class _LocalSGD:
    """Local SGD on the simulated ranks: local steps, then the models averaged through a
    :class:`ParameterAverager` per rank at the end of every round (the sync of
    :class:`commpress.local_sgd.LocalSGD`, whose constructor needs a process group)."""

    def __init__(self, cfg: Config, models: list, opts: list, sim: SimulatedWorld, steps: int) -> None:
        section = cfg.section("local_sgd")
        self.models, self.opts = models, opts
        self.flats = [FlatModel(m) for m in models]
        self.anchors = [f.read() for f in self.flats]
        self.averagers = [ParameterAverager(cfg.method, cfg.params, backend=b) for b in sim.backends]
        self.clocks = [RoundClock(period_policy(section), steps) for _ in models]

    def __call__(self, step: int, grads: list) -> None:
        for model, opt, g, clock in zip(self.models, self.opts, grads, self.clocks):
            clock.begin_step(float(opt.param_groups[0]["lr"]))
            _apply(model, opt, g)
        if all([c.end_step() for c in self.clocks]):
            self.sync()

    def sync(self) -> None:
        deltas = [f.read().sub_(a) for f, a in zip(self.flats, self.anchors)]
        futures = [avg.start(f.bucket(d)) for avg, f, d in zip(self.averagers, self.flats, deltas)]
        for fut, flat, anchor, delta, clock in zip(futures, self.flats, self.anchors, deltas, self.clocks):
            fut.wait()
            anchor.add_(delta)
            flat.write(anchor)
            clock.round_done()

    def finish(self) -> None:
        if self.clocks[0].in_round:
            self.sync()


class _CO2:
    """CO2 on the simulated ranks: one :class:`commpress.local_sgd.CO2` per rank, built as
    a ``[local_sgd]`` table builds it, averaging through its rank's backend. A sync point
    starts this round's average and applies the one every rank started a round earlier
    (already complete), so the ranks take their steps one after another."""

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
            trainer.step()

    def finish(self) -> None:
        # CO2.finish waits for the average its own last sync point starts: every rank
        # starts it first
        if self.trainers[0].clock.in_round:
            for trainer in self.trainers:
                trainer.sync()
        for trainer in self.trainers:
            trainer.finish()


def _fsdp_units(model: torch.nn.Module, sharded: Sequence[str], config: FSDPConfig) -> list[tuple[Unit, list[int], bool]]:
    """The units :func:`commpress.fsdp.apply` finds after ``fully_shard`` on each module named
    in ``sharded`` (bottom-up) and on the root: ``(unit, positions of its parameters in
    model.parameters(), whether it is the root's)``. As in FSDP2, a unit holds its modules'
    parameters in post-order (children before their parent), not entering nested units, and
    units are numbered in ``named_modules`` order, those left without parameters skipped."""
    modules = dict(model.named_modules())
    unknown = [name for name in sharded if name not in modules]
    if unknown:
        raise ValueError(f"FSDP units {unknown} are not modules of {type(model).__name__}")
    roots = {modules[name] for name in sharded} | {model}
    position = {id(p): i for i, p in enumerate(model.parameters())}
    names = {id(p): n for n, p in model.named_parameters()}
    units: list[tuple[Unit, list[int], bool]] = []
    for module in model.modules():
        if module not in roots:
            continue
        params: dict[int, torch.Tensor] = {}
        for m in _managed_modules(module, roots):
            for p in m.parameters(recurse=False):
                params.setdefault(id(p), p)
        if not params:
            continue
        shards = tuple(ParamShard(names[i], p.numel(), _chunk_rows(p) * math.prod(p.shape[1:])) for i, p in params.items())
        units.append((Unit(len(units), shards, config), [position[i] for i in params], module is model))
    return units


def _managed_modules(module: torch.nn.Module, roots: set[torch.nn.Module]) -> list[torch.nn.Module]:
    """FSDP2's walk of one ``fully_shard``-ed module: post-order, stopping at other units."""
    out: list[torch.nn.Module] = []
    visited = {module}

    def walk(m: torch.nn.Module) -> None:
        for child in m.children():
            if child not in roots and child not in visited:
                visited.add(child)
                walk(child)
        out.append(m)

    walk(module)
    return out


def _chunk_rows(t: torch.Tensor) -> int:
    """Rows of one rank's shard of ``t``: FSDP2 chunks dim 0 as ``torch.chunk`` does."""
    return -(-t.shape[0] // WORLD)


def _flat_shards(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[WORLD, n]``: row ``r`` is rank ``r``'s flat shard in FSDP2's layout (each tensor's
    dim-0 chunk ``r``, zero-padded to the first chunk's size, concatenated)."""
    parts = []
    for t in tensors:
        padded = t.new_zeros(_chunk_rows(t) * WORLD, *t.shape[1:])
        padded[: t.shape[0]] = t
        parts.append(padded.view(WORLD, -1))
    return torch.cat(parts, dim=1)


def _unshard(rows: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of :func:`_flat_shards`: full tensors shaped as ``like``, padding dropped."""
    out, pos = [], 0
    for t in like:
        width = _chunk_rows(t) * math.prod(t.shape[1:])
        out.append(rows[:, pos : pos + width].reshape(-1, *t.shape[1:])[: t.shape[0]])
        pos += width
    return out


def _mean_in_rank_order(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    # the plain reduce-scatter with ReduceOp.AVG; bit-exact with gloo's for 2 ranks (a sum of
    # two is the same in either order, and halving is exact)
    total = xs[0].clone()
    for x in xs[1:]:
        total += x
    return total.div_(len(xs))


class _QSDP:
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
        self.units = _fsdp_units(models[0], units, config)
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
            shards = _flat_shards(params)
            wire = unit.wire("weights", shards.shape[1], shards.dtype)
            nbytes = shards[0].numel() * shards.element_size()
            if wire is not None:
                nbytes, payload = wire.nbytes, torch.empty(wire.nbytes, dtype=torch.uint8)
                for r in range(WORLD):
                    wire.encode(shards[r], unit.weight_seed(r), payload)
                    wire.decode(payload, shards[r])
            gathers = 1 if root else 2
            self._count(gathers * nbytes, gathers)
            weights.update(zip(where, _unshard(shards, params)))
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
            rows = [_flat_shards([g[i] for i in where]) for g in grads]  # each rank's reduce-scatter input
            average.update(zip(where, _unshard(self._reduce_scatter(unit, rows), [self.masters[i] for i in where])))
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


def run_suite(
    tasks: Sequence[str],
    optimizers: Sequence[str],
    methods: Sequence[str],
    seeds: Sequence[int],
    steps: int,
    on_run: Callable[[QualityRun], None] | None = None,
) -> list[QualityRun]:
    """Every (task, optimizer, method, seed); ``none`` is always run (the reference)."""
    for name in tasks:
        if name not in TASKS:
            raise ConfigError(f"--tasks: {name!r} is not accepted; accepted: {', '.join(TASKS)}")
    for name in optimizers:
        if name not in OPTIMIZERS:
            raise ConfigError(f"--optimizers: {name!r} is not accepted; accepted: {', '.join(OPTIMIZERS)}")
    for name in methods:
        method_config(name, 0.1, steps)  # a bad spec fails before any training
    methods = ["none", *(m for m in methods if m != "none")]
    runs = []
    for task in tasks:
        for optimizer in optimizers:
            for method in methods:
                for seed in seeds:
                    run = train(task, optimizer, method, seed, steps)
                    runs.append(run)
                    if on_run is not None:
                        on_run(run)
    return runs


@dataclass(frozen=True)
class Summary:
    """One table row: a method's final held-out loss and its gap to ``none`` (relative,
    per seed, then mean / min / max over seeds); NaN where it could not run."""

    task: str
    optimizer: str
    method: str
    bytes_per_step: float
    loss: float
    gap_mean: float
    gap_min: float
    gap_max: float
    error: str | None


def summarize(runs: Sequence[QualityRun]) -> list[Summary]:
    """Rows in run order: per (task, optimizer, method) over seeds."""
    ref = {(r.task, r.optimizer, r.seed): r.eval_loss for r in runs if r.method == "none"}
    keyed: dict[tuple[str, str, str], list[QualityRun]] = {}
    for r in runs:
        keyed.setdefault((r.task, r.optimizer, r.method), []).append(r)
    rows = []
    for (task, optimizer, method), group in keyed.items():
        gaps = [(r.eval_loss - ref[task, optimizer, r.seed]) / ref[task, optimizer, r.seed] for r in group]
        error = next((r.error for r in group if r.error), None)
        rows.append(
            Summary(
                task,
                optimizer,
                method,
                statistics.fmean(r.bytes_per_step for r in group),
                statistics.fmean(r.eval_loss for r in group),
                statistics.fmean(gaps),
                min(gaps),
                max(gaps),
                error,
            )
        )
    return rows


def render(rows: Sequence[Summary], seeds: int) -> str:
    """The table, and under it why each n/a row could not run (rows with the same reason together)."""
    table, reasons = [], {}
    for s in rows:
        if s.error:
            reasons.setdefault(s.error, []).append(f"{s.task}/{s.optimizer}/{s.method}")
            table.append([s.task, s.optimizer, s.method, "n/a", "n/a", "n/a", "n/a"])
            continue
        spread = f"{100 * s.gap_min:+.2f}% .. {100 * s.gap_max:+.2f}%"
        table.append(
            [s.task, s.optimizer, s.method, f"{s.bytes_per_step:,.0f}", f"{s.loss:.4f}", f"{100 * s.gap_mean:+.2f}%", spread]
        )
    headers = [
        "task",
        "optimizer",
        "method",
        "bytes/step/rank",
        "final loss",
        "gap vs none",
        f"min .. max ({seeds} seed{'s' if seeds != 1 else ''})",
    ]
    notes = [f"n/a ({', '.join(where)}): {error}" for error, where in reasons.items()]
    return "\n".join([format_table(headers, table), *notes])


def write_plot(rows: Sequence[Summary], path: str) -> None:
    """One panel per (task, optimizer): the mean gap to ``none`` per method, with the
    seeds' min .. max as error bars (needs matplotlib: ``pip install 'commpress[bench]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'commpress[bench]'") from None
    panels: dict[tuple[str, str], list[Summary]] = {}
    for s in rows:
        panels.setdefault((s.task, s.optimizer), []).append(s)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), squeeze=False)
    for ax, ((task, optimizer), group) in zip(axes[:, 0], panels.items()):
        x = range(len(group))
        means = [math.nan if s.error else 100 * s.gap_mean for s in group]
        low = [0.0 if s.error else 100 * (s.gap_mean - s.gap_min) for s in group]
        high = [0.0 if s.error else 100 * (s.gap_max - s.gap_mean) for s in group]
        ax.bar(x, means, yerr=[low, high], capsize=3, color="tab:blue")
        for i, s in enumerate(group):
            if s.error:
                ax.text(i, 0, "n/a", ha="center", va="bottom")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(list(x), [s.method for s in group], rotation=30)
        ax.set_title(f"{task}, {optimizer}")
        ax.set_ylabel("gap vs none (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
