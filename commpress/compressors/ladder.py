"""The settings a layer-wise plan offers every method's tensors besides the method's own.

After a method's own knob (:meth:`~commpress.compressors.base.Compressor.ladder`) comes this pool:
PowerSGD at a few ranks (a large layer's gradient is close to low rank), then methods by bits per
element. Mixing lets a plan send a small, sensitive tensor in 4 bits and a large matrix at low rank
where Top-k would keep too few entries (docs/choosing.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from commpress.compressors.base import Setting

__all__ = ["pool"]


def pool(own: str, params: Mapping[str, Any], low_rank: Sequence[int] = ()) -> list[Setting]:
    """The pool for method ``own``'s tensors, without ``own``; its ``min_numel`` carries over."""
    small = {"min_numel": int(params["min_numel"])} if "min_numel" in params else {}
    settings: list[Setting] = [("powersgd", {"rank": r}) for r in low_rank]
    settings += [("onebit", {**small, "chunk": 64}), ("quant", {**small, "bits": 4, "error_feedback": True})]
    settings += [("terngrad", {}), ("none", {}), ("fp16", {})]
    return [s for s in settings if s[0] != own]
