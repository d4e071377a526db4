"""From a nominal byte ratio to each method's own knob, which orders the settings the planner searches.

The compressor maps it (:meth:`~commpress.compressors.base.Compressor.params_for_ratio`); 1.0 is
``none``. The mapping only has to grow with the ratio: the traffic model predicts what is sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from commpress.compressors import EXACT, ParamSlot, build

__all__ = ["adapt_state", "method_for_ratio"]

Shapes = Sequence[tuple[int, ...]]


def adapt_state(method: str, state: dict[str, Any], old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` of ``method`` under ``old`` params, made loadable under ``new``
    (:meth:`~commpress.compressors.base.Compressor.adapt_state`)."""
    if dict(old) == dict(new):
        return state
    return build(method, new).adapt_state(state, build(method, old))


def method_for_ratio(method: str, params: Mapping[str, Any], ratio: float, shapes: Shapes) -> tuple[str, dict[str, Any]]:
    """(method, params) at nominal ``ratio`` for a group's shards of ``shapes``, other configured keys kept."""
    if ratio >= 1.0:
        return EXACT, {}
    slots = [ParamSlot(f"t{i}", torch.Size(shape), 0) for i, shape in enumerate(shapes)]
    return method, {**params, **build(method, params).params_for_ratio(ratio, slots)}
