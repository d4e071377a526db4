"""Benchmark workloads: a model factory and one step's loss, the same on every method.

``gpt2``, ``bert`` and ``resnet50`` are :class:`commpress.workloads.shaped.ShapedTask`
(real layer shapes, cheap backward); ``charlm`` is a real training step of the demo model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from commpress.bench.catalog import WORKLOADS
from commpress.errors import ConfigError
from commpress.workloads import SHAPE_SETS
from commpress.workloads.charlm import CharTask
from commpress.workloads.shaped import ShapedTask

__all__ = ["WORKLOADS", "CharLMWorkload", "make_workload"]


@dataclass(frozen=True)
class CharLMWorkload:
    """The demo's next-character model and batches (``commpress demo``)."""

    batch_size: int = 64
    seed: int = 0

    @property
    def task(self) -> CharTask:
        return CharTask(batch_size=self.batch_size, seed=self.seed)

    def model(self) -> nn.Module:
        return self.task.model()

    def loss(self, model: nn.Module, step: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
        x, y = self.task.batch(step, rank, world_size)
        device = next(model.parameters()).device
        return F.cross_entropy(model(x.to(device)), y.to(device))


def make_workload(name: str, scale: float = 0.1, batch: int = 8) -> ShapedTask | CharLMWorkload:
    """The workload ``name``; ``scale`` shrinks the shaped models, ``batch`` is the rank of
    their gradients (or the demo model's batch size)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch = {batch!r} is not accepted; expected an integer >= 1")
    if name == "charlm":
        return CharLMWorkload(batch_size=batch)
    if name not in SHAPE_SETS:
        raise ConfigError(f"workload = {name!r} is not accepted; accepted: {', '.join(WORKLOADS)}")
    task = ShapedTask(name, scale, k=batch)
    task.shapes()  # validates scale
    return task
