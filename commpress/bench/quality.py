"""Training quality of every method on small tasks, in one process.

Each run trains one task with one optimizer and one method on ranks simulated by
:class:`commpress.comm.SimulatedWorld`: every rank holds its own model and optimizer,
computes the gradient of its own batch, and the real compressors (the method groups a
``CommState`` would build, ``start_iter`` included) average them, with every compressor's
``end_step(True)`` after each step; Local SGD rows average the ranks' models through the
real :class:`~commpress.comm.averager.ParameterAverager` at the rounds its period policy sets,
CO2 rows run the real :class:`~commpress.local_sgd.CO2`, one per rank, and QSDP rows (an
``[fsdp]`` table) compute with the weights commpress's quantized FSDP2 all-gather delivers
and step on the average its quantized reduce-scatter computes (the step functions are in
:mod:`commpress.bench.simulated_training`; buffers such as BatchNorm statistics as DDP or
FSDP2 leaves them). The result is the held-out loss of rank 0's model in eval mode at the
end, compared with ``none`` on the same task, optimizer and seed (the table and plot:
:mod:`commpress.bench.quality_report`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from commpress.bench.catalog import LAYERWISE_OF, METHODS, OPTIMIZERS
from commpress.bench.optimizers import make_optimizer
from commpress.bench.simulated_adam import OneBitAdamRanks
from commpress.bench.simulated_training import WORLD, OuterRanks, QSDPRanks, data_parallel, run_ranks
from commpress.cmdline import parse_method_spec
from commpress.comm import SimulatedWorld
from commpress.config import Config
from commpress.errors import ConfigError
from commpress.fsdp.config import load_fsdp_config
from commpress.workloads.charlm import CharTask
from commpress.workloads.resnet import ResNetTask
from commpress.workloads.synthetic import CharTransformerTask, ShapesTask

__all__ = ["METHODS", "OPTIMIZERS", "TASKS", "QualityRun", "method_config", "run_suite", "train"]


@dataclass(frozen=True)
class TaskSpec:
    """A task: ``make(seed)`` gives an object with ``model()``, ``batch(step, rank, world)``
    and ``eval_batch()``; ``loss(output, target)``; base learning rates by optimizer;
    ``units``: the submodules an FSDP2 run ``fully_shard``-s before the root (the QSDP rows)."""

    make: Callable[[int], Any]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    lr: dict[str, float]
    units: tuple[str, ...] = ()


TASKS: dict[str, TaskSpec] = {  # keyed by catalog.TASKS, in its order
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
    # base learning rates: the best mean held-out loss of ``none`` over seeds 0..2 at 200
    # steps among SGD 0.03, 0.1, 0.3 and AdamW 1e-3, 3e-3, 1e-2, 3e-2, 1e-1. FSDP units: the
    # stem and each residual block (the root keeps the head)
    "resnet": TaskSpec(
        lambda seed: ResNetTask(seed=seed),
        ResNetTask.loss,
        {"sgd": 0.1, "adamw": 3e-2},
        ("stem", "blocks.0", "blocks.1", "blocks.2"),
    ),
}


#: The outer step of the DiLoCo rows.
DILOCO_OUTER = {"algorithm": "diloco", "outer_lr": 0.8, "outer_momentum": 0.2}
#: How the ``streaming-diloco`` row sends its pseudo-gradients.
STREAMING_METHOD: dict[str, Any] = {"method": "terngrad"}


def method_config(label: str, lr: float, steps: int) -> dict[str, Any]:
    """The commpress config of row ``label`` for a run of ``steps`` from base learning
    rate ``lr``; a label that is no row is read as a method spec (``"topk:ratio=0.03"``).

    As in the demo, the low-rank rows start after 10% plain steps; QSR's alpha is the
    base learning rate (H = max(4, (lr0 / lr)^2): 4 steps at first, longer as lr decays);
    ``terngrad-last`` sends the last layer in full precision; ``co2`` is the demo's CO2
    (period 5, outer learning rate 0.7, averaging in bf16); ``diloco`` is DiLoCo at period
    4 with the outer Nesterov SGD at lr 0.8, momentum 0.2, and ``streaming-diloco`` the
    same outer step at period 8 over 4 fragments, each landing 1 step late, merged
    half-and-half, its pseudo-gradients in :data:`STREAMING_METHOD` (docs/local_sgd.md
    gives the measurements behind these settings); ``qsdp-w8g8`` is FSDP2 with
    commpress's ``[fsdp]`` table: 8-bit weights and gradients, the table's other defaults.
    A ``<row>-layerwise`` row is ``<row>`` with ``[layerwise] enabled = true``: each tensor's
    setting planned from the measured errors, within the bytes the row sends
    (``budget = "uniform"``), re-planned every 200 steps (the default: in a 200-step run,
    one plan, at step 1). ``onebit-adam`` is 1-bit Adam
    (``[onebit_adam]``, AdamW only): 15% exact steps, then the momentum of every tensor in 1-bit
    signs with a scale per 64 elements.
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
        "diloco": {"method": "none", "local_sgd": {**DILOCO_OUTER, "period": 4}},
        "streaming-diloco": {
            **STREAMING_METHOD,
            "local_sgd": {**DILOCO_OUTER, "period": 8, "fragments": 4, "sync_delay": 1, "merge_alpha": 0.5},
        },
        "qsdp-w8g8": {"method": "none", "fsdp": {"weight_bits": 8, "grad_bits": 8}},
        "onebit-adam": {"method": "onebit", "params": {"chunk": 64, "min_numel": 0}, "onebit_adam": {"warmup": 0.15}},
    }
    base = label.removesuffix("-layerwise")
    if label != base and base in LAYERWISE_OF:
        return {**rows[base], "layerwise": {"enabled": True}}
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
    task, base_lr = spec.make(seed), spec.lr["adamw" if optimizer == "muon" else optimizer]
    cfg = Config.load(config if config is not None else method_config(method, base_lr, steps))
    models = [task.model() for _ in range(WORLD)]
    opts = [make_optimizer(optimizer, m, base_lr) for m in models]
    sim = SimulatedWorld(WORLD)
    local = cfg.section("local_sgd")
    try:
        if cfg.section("onebit_adam") is not None:
            step_fn = OneBitAdamRanks(cfg, models, opts, sim, steps)
        elif cfg.section("fsdp") is not None:
            step_fn = QSDPRanks(load_fsdp_config(cfg), models, opts, sim, spec.units)
        elif local is None:
            step_fn = data_parallel(cfg, models, opts, sim)
        else:
            step_fn = OuterRanks(cfg, models, opts, sim, steps)
    except ConfigError as exc:
        return QualityRun(task_name, optimizer, method, seed, math.nan, math.nan, str(exc))
    # DDP broadcasts rank 0's buffers before each forward; FSDP2 does not, nor DDP under
    # [local_sgd] (commpress.local_sgd.ddp turns it off)
    broadcast = cfg.section("fsdp") is None and cfg.section("local_sgd") is None
    run_ranks(task, spec.loss, models, opts, step_fn, base_lr, steps, broadcast_buffers=broadcast)
    flats = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
    if not all(torch.equal(flats[0], f) for f in flats[1:]) and not flats[0].isnan().any():
        raise RuntimeError(f"{method}: the simulated ranks ended with different models")
    x, y = task.eval_batch()
    models[0].eval()  # BatchNorm from its running statistics
    with torch.no_grad():
        eval_loss = spec.loss(models[0](x), y).item()
    return QualityRun(task_name, optimizer, method, seed, eval_loss, sim.traffic[0].bytes_sent / steps)


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
