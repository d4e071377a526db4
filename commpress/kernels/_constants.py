"""Numbers shared by the front ends and both implementations: SplitMix64's constants, packed
sizes, the span statistics' summation layout and Top-k's threshold sizes. Kept apart so the
implementations need not import the front ends; numba compiles the functions as they are."""

from __future__ import annotations

import math

__all__ = [
    "GAMMA",
    "MASK64",
    "MIX1",
    "MIX2",
    "SEED_BASIS",
    "STATS_LANES",
    "STATS_ROWS",
    "candidate_room",
    "packed_size",
    "sample_rank",
]

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
SEED_BASIS = 0x6A09E667F3BCC908  # where derive_seed starts folding (sqrt(2) fraction bits)
# span_stats' summation layout: chunks of STATS_ROWS rows of STATS_LANES lanes (kernels/stats.py)
STATS_LANES = 256
STATS_ROWS = 64


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits occupy."""
    return (n * bits + 7) // 8


def sample_rank(k: int, n: int, sample: int, slack: float, widen: int) -> int:
    """Which largest of ``sample`` sampled magnitudes is Top-k's threshold: one that about
    ``k * slack * 4**widen`` of the ``n`` entries reach, plus 4 sigma of sampling noise."""
    expect = k / n * sample * slack * 4.0**widen
    return math.ceil(expect + 4 * math.sqrt(expect) + 1)


def candidate_room(k: int, slack: float, widen: int) -> int:
    """About how many candidates that threshold leaves (it sizes their buffers)."""
    return math.ceil(k * slack * 4.0**widen)
