"""torch's OpenMP workers and the CPU kernels' threads: how long the workers spin.

libgomp (torch's Linux OpenMP runtime) keeps its workers spinning after each parallel op, and a
compressor's hook runs right after backward's ops, so the kernels' threads would share the cores
with them; ``GOMP_SPINCOUNT=10000`` frees the cores without slowing torch (docs/kernels.md,
"Threads and torch's OpenMP workers"). libgomp reads it at load, so it must be set before the
process starts: :func:`commpress.bench.launch.run_local` does so for its ranks; with other
launchers, export it (``GOMP_SPINCOUNT=10000 torchrun ...``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["RANK_SPIN_COUNT", "rank_env", "wait_setting"]

RANK_SPIN_COUNT = "10000"  # libgomp's wait loop turns before a worker sleeps (its default: 300000)
_CHOSEN = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # a user's own choice of how the workers wait


def rank_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``GOMP_SPINCOUNT=10000`` for a rank's environment, unless ``env`` (default ``os.environ``)
    already chooses a spin count or a wait policy."""
    env = os.environ if env is None else env
    return {} if any(env.get(name) for name in _CHOSEN) else {"GOMP_SPINCOUNT": RANK_SPIN_COUNT}


def wait_setting(env: Mapping[str, str] | None = None) -> str:
    """How torch's OpenMP workers wait in this environment, as the benchmarks print it."""
    env = os.environ if env is None else env
    chosen = [f"{name}={env[name]}" for name in _CHOSEN if env.get(name)]
    return ", ".join(chosen) if chosen else "default (workers spin after each torch op)"
