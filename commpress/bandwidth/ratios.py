"""From a nominal byte ratio to each method's own parameter: how the planner walks a
method's settings from most to least compressed.

The compressor says it (:meth:`~commpress.compressors.base.Compressor.params_for_ratio`):
a method that has a knob turns a ratio into it (Top-k's ``ratio``, PowerSGD's / ACP-SGD's
``rank``), roughly so that the compressed matrices carry that fraction of their bytes; a
method without one (fp16, bf16, TernGrad) keeps its fixed parameters. A ratio of 1.0
means uncompressed: the method becomes ``none``. The mapping only has to grow with the
ratio: the planner predicts what each setting really sends (the uncompressed part, the
group size) with the traffic model and searches the ratio for the setting it wants.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from commpress.compressors import EXACT, ParamSlot, build

__all__ = ["adapt_state", "method_for_ratio"]

Shapes = Sequence[tuple[int, ...]]


def adapt_state(method: str, state: dict[str, Any], old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` of ``method`` with parameters ``old``, made loadable with ``new``
    (:meth:`~commpress.compressors.base.Compressor.adapt_state`)."""
    if dict(old) == dict(new):
        return state
    return build(method, new).adapt_state(state, build(method, old))


def method_for_ratio(method: str, params: Mapping[str, Any], ratio: float, shapes: Shapes) -> tuple[str, dict[str, Any]]:
    """(method, params) at nominal ``ratio`` for gradient tensors of ``shapes`` (a group's
    shards); ``params`` are the configured ones, other keys kept."""
    if ratio >= 1.0:
        return EXACT, {}
    slots = [ParamSlot(f"t{i}", torch.Size(shape), 0) for i, shape in enumerate(shapes)]
    return method, {**params, **build(method, params).params_for_ratio(ratio, slots)}
