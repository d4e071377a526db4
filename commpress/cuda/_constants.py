"""Numbers the CPU paths and the compiled kernels share: the SplitMix64 constants of the
counter-based generator and the size of packed codes. A module of its own so the compiled
kernels can use them without importing the dispatching modules (no import circle)."""

from __future__ import annotations

__all__ = ["GAMMA", "MASK64", "MIX1", "MIX2", "SEED_BASIS", "packed_size"]

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
SEED_BASIS = 0x6A09E667F3BCC908  # where derive_seed starts folding (sqrt(2) fraction bits)


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits occupy."""
    return (n * bits + 7) // 8
