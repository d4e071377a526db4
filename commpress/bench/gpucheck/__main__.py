"""Run the GPU check: every part in its own process under its own time cap.

    python -m commpress.bench.gpucheck OUT [--dry] [--budget 540] [--slack 1] [--parts env,tests,...]

Parts run one after another (they share the GPU), each under the smaller of its cap
(:data:`PARTS`, times ``--slack`` on a slow machine) and what is left of ``--budget``; a part past its cap is killed with
every process it started (its own process group), recorded as ``timeout``, and the next
part runs. Writes ``OUT/gpu-check.json`` (every part's report, the overall status) and
``OUT/gpu-check.log`` (every part's output); prints one line per part.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from commpress.kernels.cpu.openmp import rank_env

#: part -> its time cap in seconds, in the order they run (540 s in all)
PARTS = {"env": 30, "tests": 120, "kernels": 60, "ddp": 135, "configs": 60, "lowrank": 60, "fsdp": 40, "sharded": 35}
ROOT = Path(__file__).resolve().parents[3]
FINAL = 15  # seconds a part needs at least; with less budget left it is not started
RUNNING = "COMMPRESS_GPU_CHECK"  # set in the parts' environment: a check started inside one refuses


def _parts(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--parts {text!r}: unknown part(s) {unknown}; accepted: {', '.join(PARTS)}")
    return names


def _at_least(option: str, low: float) -> Callable[[str], float]:
    """A command-line type: a number of at least ``low``, else an error naming ``option``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value >= low:
            raise argparse.ArgumentTypeError(f"{option} = {text!r} is not accepted; expected a number >= {low:g}")
        return value

    return parse


def run_part(name: str, out: Path, dry: bool, cap: float, log: IO[str]) -> dict[str, Any]:
    """Run one part under ``cap`` seconds; its report, with how it ended."""
    command = [sys.executable, "-m", f"commpress.bench.gpucheck.{name}", str(out), *(["--dry"] if dry else [])]
    env = {
        **os.environ,
        **rank_env(),  # torch's OpenMP workers stop spinning soon, as in every rank commpress starts
        RUNNING: "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    log.write(f"\n===== {name} (cap {cap:.0f} s): {' '.join(command)}\n")
    log.flush()
    report_path = out / f"{name}.json"
    report_path.unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code: int | None = proc.wait(timeout=cap)
    except subprocess.TimeoutExpired:
        code = None
    with contextlib.suppress(ProcessLookupError):  # the part, and every rank it started and left behind
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    seconds = round(time.perf_counter() - start, 2)
    if code is None:
        return {"part": name, "status": "timeout", "seconds": seconds, "error": f"killed after its cap of {cap:.0f} s"}
    if not report_path.exists():
        return {"part": name, "status": "error", "seconds": seconds, "error": f"exited with code {code} without a report"}
    return {**json.loads(report_path.read_text()), "seconds": seconds, "exit_code": code}


def _summary(report: dict[str, Any]) -> str:
    failed = [c["name"] for c in report.get("checks", []) if not c["ok"]]
    text = f"{report['part']:<8} {report['status']:<8} {report['seconds']:7.1f} s"
    if report.get("error"):
        text += f"  {report['error']}"
    if failed:
        text += f"  failed: {'; '.join(failed)}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commpress.bench.gpucheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the JSON reports and the log (created)")
    parser.add_argument("--dry", action="store_true", help="run without CUDA: small sizes, what needs a GPU skipped")
    parser.add_argument(
        "--budget", type=_at_least("--budget", FINAL), default=540.0, help="seconds for all parts together (default 540)"
    )
    parser.add_argument(
        "--slack", type=_at_least("--slack", 1), default=1.0, help="multiply every part's cap (a busy machine; default 1)"
    )
    parser.add_argument(
        "--parts", type=_parts, default=list(PARTS), help=f"which parts, comma-separated (default all: {','.join(PARTS)})"
    )
    args = parser.parse_args(argv)
    if os.environ.get(RUNNING):
        parser.error(f"a GPU check is running above this process ({RUNNING} is set): one would start the other without end")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    reports: dict[str, dict[str, Any]] = {}
    with open(out / "gpu-check.log", "a") as log:
        for name in args.parts:
            left = args.budget - (time.perf_counter() - started)
            if left < FINAL:
                reports[name] = {
                    "part": name,
                    "status": "not run",
                    "seconds": 0.0,
                    "error": f"--budget {args.budget:.0f} s spent",
                }
            else:
                cap = min(PARTS[name] * args.slack, left)
                reports[name] = {**run_part(name, out, args.dry, cap, log), "cap_s": round(cap, 1)}
            print(_summary(reports[name]), flush=True)
    good = all(r["status"] in ("ok", "skipped") for r in reports.values())
    summary = {
        "status": "ok" if good else "failed",
        "dry": args.dry,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 1),
        "budget_s": args.budget,
        "command": [sys.argv[0], *(argv if argv is not None else sys.argv[1:])],
        "parts": reports,
    }
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"gpu-check {summary['status']} in {summary['seconds']} s -> {out / 'gpu-check.json'}", flush=True)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
