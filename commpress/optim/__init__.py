"""Compression that takes over part of the optimizer's step: 1-bit Adam (the momentum
averaged compressed once AdamW's variance is frozen)."""

from commpress.optim.onebit_adam import OneBitAdam, check_adam

__all__ = ["OneBitAdam", "check_adam"]
