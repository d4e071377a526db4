"""What every part of the GPU check shares: its report, its command line, one-rank groups.

A part is a module with ``run(report, dry)``; ``python -m commpress.bench.gpucheck.<part>
OUT [--dry]`` runs it and writes ``OUT/<part>.json``. The report says what ran, what was
skipped and why, every check (passed or not, with the numbers behind it) and the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["RUNS", "Report", "cuda_against_cpu", "main", "no_cuda", "on_ranks", "one_rank"]


class Report:
    """One part's findings; :attr:`status` sums them up."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.ran: list[str] = []
        self.skipped: dict[str, str] = {}
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}
        self.error: str | None = None

    def skip(self, what: str, reason: str) -> None:
        self.skipped[what] = reason

    def check(self, name: str, ok: bool, **detail: Any) -> bool:
        """Record a check; returns ``ok``."""
        self.checks.append({"name": name, "ok": bool(ok), **detail})
        print(f"[{self.part}] {'ok  ' if ok else 'FAIL'} {name} {json.dumps(detail, default=str)}", flush=True)
        return bool(ok)

    @property
    def status(self) -> str:
        """``error`` (the part raised), ``failed`` (a check failed), ``skipped`` (nothing
        ran), else ``ok``."""
        if self.error is not None:
            return "error"
        if any(not c["ok"] for c in self.checks):
            return "failed"
        return "ok" if self.ran else "skipped"

    def as_dict(self, seconds: float) -> dict[str, Any]:
        return {
            "part": self.part,
            "status": self.status,
            "seconds": round(seconds, 2),
            "ran": self.ran,
            "skipped": self.skipped,
            "checks": self.checks,
            "figures": self.figures,
            "error": self.error,
        }


def no_cuda(dry: bool) -> str | None:
    """Why the CUDA side of a part cannot run (None: it can)."""
    if dry:
        return "--dry: the CUDA side is skipped"
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    return None


#: A training run on ``device``: its losses per step, its held-out loss, more figures.
Training = Callable[[str], tuple[list[float], float, dict[str, Any]]]


def cuda_against_cpu(report: Report, prefix: str, train: Training, dry: bool, rtol: float, what: str = "") -> None:
    """``train`` on one NCCL rank on the GPU (``prefix`` + ``cuda-nccl-1``), then on one
    gloo CPU rank (``cpu-gloo-1``), each in a one-rank group of its own; checks that each
    trains (finite losses) and, on the GPU's sizes, that its loss falls, then that the GPU's
    losses are within ``rtol`` of the CPU's, relative. ``what`` names the run in the checks.
    The CUDA run goes first: were a second process group in this process to fail, it is the
    one kept. Without CUDA (or ``dry``) its side is skipped with the reason."""
    reason = no_cuda(dry)
    runs = {}
    for side, device, backend in (("cuda-nccl-1", "cuda", "nccl"), ("cpu-gloo-1", "cpu", "gloo")):
        name = prefix + side
        if device == "cuda" and reason is not None:
            report.skip(name, reason)
            continue
        with one_rank(backend):
            losses, eval_loss, figures = train(device)
        runs[side] = [*losses, eval_loss]
        report.ran.append(name)
        report.figures[name] = {"losses": losses, "eval_loss": eval_loss, **figures}
        report.check(f"{name}: {what + ' ' if what else ''}trains (finite losses)", all(map(math.isfinite, runs[side])))
        if not dry:
            report.check(f"{name}: the loss falls", losses[-1] < losses[0], first=losses[0], last=losses[-1])
    if "cuda-nccl-1" in runs:
        worst = max(abs(a - b) / abs(a) for a, b in zip(runs["cpu-gloo-1"], runs["cuda-nccl-1"]))
        report.check(
            f"{prefix}cuda-nccl-1 losses within {rtol:.0%} of {prefix}cpu-gloo-1's", worst <= rtol, largest_relative=worst
        )
    else:
        report.skip(f"{prefix}cuda-nccl-1 against {prefix}cpu-gloo-1", reason or "not run")


#: the runs of the parts that compare devices: run -> (device, backend, ranks)
RUNS = {
    "cpu-gloo-2": ("cpu", "gloo", 2),
    "cpu-gloo-1": ("cpu", "gloo", 1),
    "cuda-gloo-2": ("cuda", "gloo", 2),
    "cuda-nccl-1": ("cuda", "nccl", 1),
}


def on_ranks(train: Callable[..., dict[str, Any]], name: str, *args: Any) -> list[dict[str, Any]]:
    """Every rank's ``train(rank, world, device, *args)`` of the run ``name`` (:data:`RUNS`): in
    this process on one rank, else in local rank processes."""
    from commpress.bench.launch import run_local

    device, backend, ranks = RUNS[name]
    if ranks == 1:
        with one_rank(backend):
            return [train(0, 1, device, *args)]
    return run_local(train, ranks, device, *args, backend=backend, timeout=240)


@contextlib.contextmanager
def one_rank(backend: str) -> Iterator[None]:
    """A one-rank default process group in this process (``backend`` gloo or nccl)."""
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


def main(part: str, run: Callable[[Report, bool], None], argv: list[str] | None = None) -> None:
    """The command line of a part: ``OUT [--dry]``; writes ``OUT/<part>.json`` whatever happens."""
    parser = argparse.ArgumentParser(prog=f"python -m commpress.bench.gpucheck.{part}")
    parser.add_argument("out", type=Path, help="folder for the part's JSON")
    parser.add_argument("--dry", action="store_true", help="small sizes; what needs CUDA is skipped")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(part)
    start = time.perf_counter()
    try:
        run(report, args.dry)
    except BaseException as exc:
        traceback.print_exc()
        report.error = f"{type(exc).__name__}: {exc}"
    finally:
        path = args.out / f"{part}.json"
        path.write_text(json.dumps(report.as_dict(time.perf_counter() - start), indent=1, default=str))
        print(f"[{part}] {report.status} -> {path}", flush=True)
    sys.exit(0 if report.status in ("ok", "skipped") else 1)
