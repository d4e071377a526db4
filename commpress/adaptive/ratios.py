"""From a nominal byte ratio to each method's own parameter: how the planner walks a
method's settings from most to least compressed.

A method that has a knob turns a ratio into it here (Top-k's ``ratio``, PowerSGD's /
ACP-SGD's ``rank``), roughly so that the compressed matrices carry that fraction of their
bytes; a method without one (fp16, bf16, TernGrad) keeps its fixed parameters. A ratio of
1.0 means uncompressed: the method becomes ``none``. The mapping only has to grow with
the ratio: the planner predicts what each setting really sends (the uncompressed part,
the group size) with the traffic model and searches the ratio for the setting it wants.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["adapt_state", "method_for_ratio", "register_ratio_mapping"]

Shapes = Sequence[tuple[int, ...]]
RatioMapping = Callable[[float, Mapping[str, Any], Shapes], dict[str, Any]]
#: ``fn(state, old_params, new_params) -> state``: a compressor's ``state_dict`` made
#: loadable by an instance with other parameters.
StateAdapter = Callable[[dict[str, Any], Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]
_MAPPINGS: dict[str, RatioMapping] = {}
_ADAPTERS: dict[str, StateAdapter] = {}


def register_ratio_mapping(method: str, adapt: StateAdapter | None = None) -> Callable[[RatioMapping], RatioMapping]:
    """Decorator: ``fn(ratio, params, shapes) -> params`` sets ``method``'s knob for a ratio.
    ``adapt`` converts the method's state when the knob changes (default: unchanged)."""

    def deco(fn: RatioMapping) -> RatioMapping:
        _MAPPINGS[method] = fn
        if adapt is not None:
            _ADAPTERS[method] = adapt
        return fn

    return deco


def adapt_state(method: str, state: dict[str, Any], old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` of ``method`` with parameters ``old``, made loadable with ``new``."""
    fn = _ADAPTERS.get(method)
    return fn(state, old, new) if fn is not None and dict(old) != dict(new) else state


def method_for_ratio(method: str, params: Mapping[str, Any], ratio: float, shapes: Shapes) -> tuple[str, dict[str, Any]]:
    """(method, params) at nominal ``ratio`` for gradient tensors of ``shapes`` (a group's
    shards); ``params`` are the configured ones, other keys kept."""
    if ratio >= 1.0:
        return "none", {}
    fn = _MAPPINGS.get(method)
    return method, fn(ratio, params, shapes) if fn is not None else dict(params)


def _matrices(shapes: Shapes) -> list[tuple[int, int]]:
    """Tensors as the low-rank methods see them: (rows, rest); 1-D tensors are left out."""
    return [(s[0], math.prod(s[1:])) for s in shapes if len(s) >= 2]


def _low_rank(per_step: float) -> RatioMapping:
    """A rank-r factorization sends r*(n+m) of n*m numbers, ``per_step`` times that per step."""

    def fn(ratio: float, params: Mapping[str, Any], shapes: Shapes) -> dict[str, Any]:
        mats = _matrices(shapes)
        full = sum(n * m for n, m in mats)
        sides = sum(n + m for n, m in mats)
        rank = max(1, math.floor(ratio * full / (per_step * sides))) if sides else 1
        return {**params, "rank": rank}

    return fn


def _drop_factors(state: dict[str, Any], old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A new rank keeps every parameter's error buffer (error feedback) and restarts the
    warm start: the saved factors have the old rank's width."""
    if old.get("rank") == new.get("rank"):
        return state
    return {**state, "q": {}, "p": {}}


register_ratio_mapping("powersgd", _drop_factors)(_low_rank(1.0))  # P and Q every step
register_ratio_mapping("acpsgd", _drop_factors)(_low_rank(0.5))  # P or Q, alternating


@register_ratio_mapping("topk")
def _topk(ratio: float, params: Mapping[str, Any], shapes: Shapes) -> dict[str, Any]:
    """Each kept element costs its value (4 or 2 bytes) plus a 4-byte index."""
    dtype = str(params.get("value_dtype", "float32"))
    value_bytes = 2 if "16" in dtype else 4
    return {**params, "ratio": min(1.0, ratio * 4 / (value_bytes + 4))}
