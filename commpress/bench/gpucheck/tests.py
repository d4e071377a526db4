"""Part ``tests``: ``pytest -m cuda`` and every test that skips without CUDA.

The tests are chosen at collection, by their marks: the ``cuda`` mark, or a ``skipif``
whose reason names CUDA, a GPU or NCCL (:data:`CUDA_REASON`). Only files whose text
matches that pattern are collected (a test file that never names them cannot carry such a
mark), which keeps the collection short. On a GPU every chosen test must pass (a skip
there is a test that needs something else too: reported as a failed check); on the CPU
(``--dry``) every chosen test must skip, which is the check that the choice is right.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from commpress.bench.gpucheck.part import Report, main, no_cuda

CUDA_REASON = re.compile(r"cuda|gpu|nccl", re.IGNORECASE)
ROOT = Path(__file__).resolve().parents[3]


def why_chosen(item: Any) -> str | None:
    """Why a collected test belongs to the part (None: it does not)."""
    if item.get_closest_marker("cuda") is not None:
        return "marked cuda"
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if CUDA_REASON.search(reason):
            return f"skips without CUDA: {reason}"
    return None


class Chooser:
    """A pytest plugin: keeps the chosen tests and records each one's outcome."""

    def __init__(self) -> None:
        self.chosen: dict[str, str] = {}
        self.outcomes: dict[str, dict[str, str]] = {}

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        keep, drop = [], []
        for item in items:
            why = why_chosen(item)
            if why is None:
                drop.append(item)
            else:
                self.chosen[item.nodeid] = why
                keep.append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep

    def pytest_runtest_logreport(self, report: Any) -> None:
        seen = self.outcomes.get(report.nodeid, {}).get("outcome")
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
            self.outcomes[report.nodeid] = {"outcome": outcome, "message": _text(report.longrepr)[-2000:]}
        elif report.skipped and seen is None:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else _text(report.longrepr)
            self.outcomes[report.nodeid] = {"outcome": "skipped", "message": str(reason)}
        elif report.passed and report.when == "call" and seen is None:
            self.outcomes[report.nodeid] = {"outcome": "passed"}


def _text(longrepr: Any) -> str:
    return str(longrepr) if longrepr is not None else ""


#: the check's own test runs the check: never chosen
OWN_TEST = "test_gpu_check.py"


def candidate_files(root: Path = ROOT) -> list[Path]:
    """The test files that name CUDA, a GPU or NCCL anywhere in their text, but the check's own."""
    files = (root / "tests").glob("test_*.py")
    return sorted(p for p in files if p.name != OWN_TEST and CUDA_REASON.search(p.read_text()))


def run(report: Report, dry: bool) -> None:
    import pytest

    files = candidate_files()
    chooser = Chooser()
    args = ["-q", "-rA", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(ROOT), *map(str, files)]
    code = pytest.main(args, plugins=[chooser])
    report.ran.append("pytest")
    counts: dict[str, int] = {}
    for result in chooser.outcomes.values():
        counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
    report.figures.update(
        {"files": [str(f.relative_to(ROOT)) for f in files], "chosen": chooser.chosen, "counts": counts, "pytest_exit": int(code)}
    )
    report.figures["outcomes"] = chooser.outcomes
    report.check("tests were chosen", bool(chooser.chosen), chosen=len(chooser.chosen))
    report.check("every chosen test ran to an outcome", set(chooser.outcomes) == set(chooser.chosen), counts=counts)
    bad = {k: v for k, v in chooser.outcomes.items() if v["outcome"] in ("failed", "error")}
    report.check("none failed", not bad, failed=sorted(bad))
    skipped = {k: v["message"] for k, v in chooser.outcomes.items() if v["outcome"] == "skipped"}
    reason = no_cuda(False)  # pytest sees the device whether or not the run is dry
    if reason is None:  # CUDA is here: nothing may skip
        report.check("none skipped on the GPU", not skipped, skipped=skipped)
    else:  # every chosen test must skip, for CUDA
        off = {k: m for k, m in skipped.items() if not CUDA_REASON.search(m)}
        ran = sorted(set(chooser.outcomes) - set(skipped))
        report.check("without CUDA every chosen test skips, for CUDA", not off and not ran, other_reasons=off, ran=ran)
        report.skip("the chosen tests on a GPU", reason)


if __name__ == "__main__":
    main("tests", run)
