"""What takes part in the optimizer's step: 1-bit Adam (also under a torchft Manager), Dion in
place of Muon's step, and the hybrid optimizer (Muon + AdamW stepping one iteration)."""

from commpress.optim.dion import Dion
from commpress.optim.hybrid import HybridOptimizer
from commpress.optim.momentum import AtTheStep, InTheBackward
from commpress.optim.onebit_adam import OneBitAdam, check_adam

__all__ = ["AtTheStep", "Dion", "HybridOptimizer", "InTheBackward", "OneBitAdam", "check_adam"]
