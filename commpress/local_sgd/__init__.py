"""Local SGD, CO2 and DiLoCo: each rank steps its own model, and from time to time (a constant
period or QSR) the ranks average the pseudo-gradient for an outer optimizer to step the shared
anchor. CO2 overlaps the averaging with the next round; Streaming DiLoCo syncs fragments overlapped
with inner steps. All run on a process group or under a torchft Manager."""

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
