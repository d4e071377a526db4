"""torch's OpenMP workers and the CPU kernels' threads: how long the workers spin.

After every parallel torch op, libgomp (the OpenMP runtime of torch's Linux wheels) keeps
its workers spinning for a while (its default ``GOMP_SPINCOUNT`` of 300,000 turns of a
wait loop: 5 to 10 ms on this project's CI machine) so the next op starts without a wake-up.
The CPU kernels run on commpress's own pool of ``torch.get_num_threads()`` threads, and a
compressor's hook runs right after backward's torch ops, so its threads share the cores
with spinning workers and lose up to a third of their speed. A spin count of 10,000
(well under a millisecond) frees the cores at once without slowing torch's own ops
(measurements in docs/kernels.md, "Threads and torch's OpenMP workers").

libgomp reads these variables once, when torch loads it, so they must be in a process's
environment before it starts: :func:`commpress.bench.launch.run_local` sets the default for
the ranks it starts; for other launchers export it (``GOMP_SPINCOUNT=10000 torchrun ...``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["RANK_SPIN_COUNT", "rank_env", "wait_setting"]

RANK_SPIN_COUNT = "10000"  # libgomp's wait loop turns before a worker sleeps (its default: 300000)
_CHOSEN = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # a user's own choice of how the workers wait


def rank_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to a rank's environment: ``GOMP_SPINCOUNT=10000``, unless
    ``env`` (default ``os.environ``) already chooses a spin count or a wait policy."""
    env = os.environ if env is None else env
    return {} if any(env.get(name) for name in _CHOSEN) else {"GOMP_SPINCOUNT": RANK_SPIN_COUNT}


def wait_setting(env: Mapping[str, str] | None = None) -> str:
    """How torch's OpenMP workers wait in this environment, as the benchmarks print it."""
    env = os.environ if env is None else env
    chosen = [f"{name}={env[name]}" for name in _CHOSEN if env.get(name)]
    return ", ".join(chosen) if chosen else "default (workers spin after each torch op)"
