"""The kernels of a Local SGD, CO2 or DiLoCo trainer's averaging loaded at registration
(:mod:`commpress.comm.warm`), not inside its first sync, which the peers wait for."""

from __future__ import annotations

from commpress.comm.warm import load_kernels
from commpress.local_sgd.trainer import Trainer

__all__ = ["load_trainer_kernels"]


def load_trainer_kernels(trainer: Trainer) -> None:
    """Run ``trainer``'s averaging once, by fresh compressors in a simulated world, on tensors
    shaped like the flat model's (so every DiLoCo fragment's too), leaving ``trainer`` unchanged."""
    flat = trainer.flat
    load_kernels(trainer.averager.groups, [(s.name, s.shape) for s in flat.slots], flat.dtype, flat.device)
