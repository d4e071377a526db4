"""The outer optimizer of a Local SGD trainer: its builder, and the checks on a user's one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from commpress.errors import ConfigError

__all__ = ["OuterOptimizer", "check_outer_arguments", "describe_optimizer"]

#: Builds the outer optimizer over the anchor's tensors (one flat tensor, or one per
#: DiLoCo fragment), e.g. ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)``.
OuterOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def describe_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A user's outer optimizer as settings the ranks compare: its class and defaults."""
    kind = type(optimizer)
    return {"class": f"{kind.__module__}.{kind.__qualname__}", **{k: v for k, v in optimizer.defaults.items() if k != "params"}}


def check_outer_arguments(name: str, outer_optimizer: OuterOptimizer | None, built_in: Mapping[str, Any]) -> None:
    """Refuse the built-in outer SGD's arguments (``built_in``, None where unset) beside ``outer_optimizer``."""
    given = [key for key, value in built_in.items() if value is not None]
    if outer_optimizer is not None and given:
        raise ConfigError(
            f"{name}: {', '.join(given)} = {', '.join(repr(built_in[k]) for k in given)} is not accepted with "
            "outer_optimizer; expected None (set them in the optimizer outer_optimizer builds)"
        )
