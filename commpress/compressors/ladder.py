"""The settings a layer-wise plan offers every method's tensors besides the method's own.

A method's ladder (:meth:`~commpress.compressors.base.Compressor.ladder`) is its own knob
around the configured setting, then this pool: PowerSGD at a few ranks where the method
asks for them (a large layer's gradient is close to low rank, and rank r costs
``r (n + m)`` floats, below Top-k 1% of a 512 x 768 matrix up to r = 6), and a ladder of
other methods by bits per element, from about 1.5 to 32: ``onebit`` with a scale per 64
elements and 4-bit ``quant`` (both with error feedback), ``terngrad``, ``none``, ``fp16``.
Mixing methods lets a plan send a small, sensitive tensor in 4 bits where the main method's
setting would need many times its bytes, and a large matrix at low rank where Top-k would
keep too few entries (measured: docs/choosing.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from commpress.compressors.base import Setting

__all__ = ["pool"]


def pool(own: str, params: Mapping[str, Any], low_rank: Sequence[int] = ()) -> list[Setting]:
    """The pool for tensors of method ``own`` configured with ``params``: PowerSGD at the
    ranks ``low_rank``, then the bits-per-element ladder, leaving out ``own``'s settings;
    tensors under the method's ``min_numel`` stay whole in the pool's methods too."""
    small = {"min_numel": int(params["min_numel"])} if "min_numel" in params else {}
    settings: list[Setting] = [("powersgd", {"rank": r}) for r in low_rank]
    settings += [("onebit", {**small, "chunk": 64}), ("quant", {**small, "bits": 4, "error_feedback": True})]
    settings += [("terngrad", {}), ("none", {}), ("fp16", {})]
    return [s for s in settings if s[0] != own]
