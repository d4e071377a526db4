"""Local SGD, CO2 and DiLoCo: each rank takes local optimizer steps and the ranks average
their models from time to time (a constant period or the Quadratic Synchronization Rule),
through one step of an outer optimizer (any ``torch.optim.Optimizer``) on the averaged
pseudo-gradient; CO2 overlaps that averaging with the next round's computation, Streaming
DiLoCo syncs fragments overlapped with a few inner steps. Each runs on a fixed process
group or under a torchft Manager alike (:mod:`commpress.local_sgd.transaction`)."""

from commpress.local_sgd.co2 import CO2, ClippedSGD
from commpress.local_sgd.config import LocalSGDConfig, from_config
from commpress.local_sgd.ddp import local_gradients_hook, skip_gradient_allreduce
from commpress.local_sgd.diloco import DiLoCo
from commpress.local_sgd.local_sgd import LocalSGD
from commpress.local_sgd.outer import OuterOptimizer
from commpress.local_sgd.periods import QSR, Constant, Period, qsr_period
from commpress.local_sgd.trainer import Trainer

__all__ = [
    "CO2",
    "QSR",
    "ClippedSGD",
    "Constant",
    "DiLoCo",
    "LocalSGD",
    "LocalSGDConfig",
    "OuterOptimizer",
    "Period",
    "Trainer",
    "from_config",
    "local_gradients_hook",
    "qsr_period",
    "skip_gradient_allreduce",
]
