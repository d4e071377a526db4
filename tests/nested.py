"""Equality of nested states (dicts, lists and tuples of tensors and plain values), tensors
compared bit for bit: what tests compare compressor and trainer states with."""

from __future__ import annotations

from typing import Any

import torch


def same_nested(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same keys, lengths and values, tensors equal to the bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_nested(x, y) for x, y in zip(a, b))
    return a == b
