"""Names and seeds for the random choices of stochastic compressors: per rank, per step, per tensor.

A seed depends on the parameter's *name*, not on its bucket or position, so the random
bits a tensor gets do not change when DDP rebuilds its buckets, when ``bucket_cap_mb``
changes, or when a resumed run starts with DDP's initial bucket layout again. Runs are
reproducible; ranks and steps draw independent numbers.
"""

from __future__ import annotations

import zlib

from commpress.compressors.base import Bucket, ParamSlot
from commpress.cuda import derive_seed
from commpress.errors import ConfigError

__all__ = ["check_seed", "tensor_key", "tensor_seed"]


def tensor_key(bucket: Bucket, slot: ParamSlot) -> str:
    """What identifies a tensor across steps and bucket layouts: its parameter name. A
    bucket without parameter names has one slot called "flat"; it is named after the bucket."""
    return f"flat{bucket.index}" if slot.name == "flat" else slot.name


def tensor_seed(seed: int, rank: int, step: int, name: str) -> int:
    """The counter-based generator's key for tensor ``name`` on ``rank`` at ``step``."""
    return derive_seed(seed, rank, step, zlib.crc32(name.encode()))


def check_seed(where: str, seed: int) -> None:
    """Seeds are 63-bit non-negative integers (they are mixed into a 64-bit key)."""
    if not 0 <= seed < 2**63:
        raise ConfigError(f"{where}: seed = {seed!r} is not accepted; expected an integer in [0, 2**63)")
