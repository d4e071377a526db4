"""Compression that takes over part of the optimizer's step: 1-bit Adam (the momentum
averaged compressed once AdamW's variance is frozen), also under a torchft Manager."""

from commpress.optim.momentum import AtTheStep, InTheBackward
from commpress.optim.onebit_adam import OneBitAdam, check_adam

__all__ = ["AtTheStep", "InTheBackward", "OneBitAdam", "check_adam"]
