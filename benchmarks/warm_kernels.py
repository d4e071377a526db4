"""How long ``commpress.register()`` and the first training steps take in fresh processes,
with the kernels loaded at registration (``commpress.comm.warm``) or, ``--skip-warmup``,
left to the first steps (commpress before 2026-12-01).

    NUMBA_CACHE_DIR=$(mktemp -d) python benchmarks/warm_kernels.py docs/configs/topk.toml [--skip-warmup]

Two gloo ranks (``run_local``) train the race transformer (width 256, 4 layers, 4 heads,
context 64: 3.24M parameters) under DDP with the config (SGD, or AdamW for ``[local_sgd]``
and ``[onebit_adam]``); each rank times ``register()`` and each of the first ``--steps``
steps (forward, backward, ``optimizer.step()``). Prints each rank's times and the
kernels' signatures the steps added. ``NUMBA_CACHE_DIR`` pointing at an empty directory
is a first run; run again with the same directory for a run whose kernels are cached.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import pkgutil
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import commpress
from commpress.bench.launch import run_local
from commpress.workloads.synthetic import CharTransformerTask

TASK = CharTransformerTask(context=64, width=256, layers=4, heads=4)


def _signatures() -> int:
    """The signatures the CPU kernels' numba dispatchers hold in this process."""
    import commpress.kernels.cpu as cpu

    count = 0
    for info in pkgutil.iter_modules(cpu.__path__):
        module = importlib.import_module(f"{cpu.__name__}.{info.name}")
        count += sum(len(v.signatures) for v in vars(module).values() if hasattr(v, "signatures"))
    return count


def _rank(rank: int, world: int, config: str, skip: bool, steps: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(TASK.model())
    text = Path(config).read_text()
    adam = "[local_sgd]" in text or "[onebit_adam]" in text
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if adam else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    skipped = mock.patch("commpress.comm.warm.layouts", side_effect=lambda *a: []) if skip else contextlib.nullcontext()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    with skipped:
        reg = commpress.register(model, config, optimizer=opt, total_steps=100)
    registered = time.perf_counter() - t0
    loaded = _signatures()
    times = []
    for step in range(steps):
        x, y = TASK.batch(step, rank, world)
        t0 = time.perf_counter()
        opt.zero_grad()
        TASK.loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    reg.remove()
    return {"register": registered, "steps": times, "added": _signatures() - loaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--skip-warmup", action="store_true", help="leave the kernels to the first steps")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    for rank, got in enumerate(run_local(_rank, 2, args.config, args.skip_warmup, args.steps)):
        steps = " ".join(f"{t:.2f}" for t in got["steps"])
        print(
            f"{args.config} {'skip' if args.skip_warmup else 'warm'} rank {rank}: register {got['register']:.2f} s, "
            f"steps {steps} s (sum {sum(got['steps']):.2f}), signatures added by the steps {got['added']}"
        )


if __name__ == "__main__":
    main()
