"""``commpress race``: a short real race on 2 ranks, the JSON it writes, methods that never
reach the target (reported, not dropped), and the command line's checks."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch.distributed as dist

from commpress.bench.methods import parse_methods
from commpress.bench.race import RacePlan, RaceTask, race_rank
from commpress.bench.race_report import format_report, summarize
from commpress.cli import main
from commpress.errors import ConfigError

#: a transformer small enough for a few steps on 2 cores
TINY = ["--width", "16", "--layers", "1", "--heads", "2", "--context", "16", "--batch", "4", "--eval-size", "16"]
ROW_FIELDS = {"method", "time_to_target_s", "steps_to_target", "final_loss", "bytes_per_step", "curve"}


def test_two_ranks_race_end_to_end(tmp_path):
    out, plot = tmp_path / "race.json", tmp_path / "race.png"
    methods = "torch-powersgd:rank=2;powersgd:rank=2;ddp"  # ddp moves first: it sets the target
    argv = ["race", "--local", "2", *TINY, "--target-steps", "4", "--eval-every", "2", "--warmup", "1"]
    assert main([*argv, "--methods", methods, "--json", str(out), "--plot", str(plot), "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert {"target", "link", "rows"} <= set(report) and report["world_size"] == 2
    assert [r["method"] for r in report["rows"]] == ["ddp", "torch-powersgd:rank=2", "powersgd:rank=2"]
    assert all(set(r) >= ROW_FIELDS for r in report["rows"])
    ddp = report["rows"][0]
    assert ddp["final_loss"] == report["target"] and ddp["steps_to_target"] <= 4 and ddp["time_to_target_s"] > 0
    assert 0 < report["rows"][2]["bytes_per_step"] < ddp["bytes_per_step"] == report["task"]["grad_bytes"]
    assert report["rows"][1]["note"] == "1 bucket"
    assert all(r["curve"][0]["step"] == 0 and r["steps"] <= 8 for r in report["rows"])  # cap: twice the target steps
    assert plot.stat().st_size > 0


@pytest.fixture
def one_rank():
    """A gloo process group of this process alone."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _race(**kwargs) -> dict:
    task = RaceTask("transformer", batch=4, context=16, width=16, layers=1, heads=2, eval_size=8)
    plan = RacePlan(
        methods=tuple(parse_methods("ddp;topk:ratio=0.1")), task=task, eval_every=1, warmup=0, progress=False, **kwargs
    )
    return summarize(race_rank(0, 1, plan))


def test_a_target_below_any_reachable_loss_is_not_reached(one_rank):
    summary = _race(target=0.01, max_steps=2)
    assert [r["method"] for r in summary["rows"]] == ["ddp", "topk:ratio=0.1"]
    for r in summary["rows"]:
        assert r["time_to_target_s"] is None and r["steps_to_target"] is None and r["steps"] == 2
        assert r["speedup_over_ddp"] is None and r["speedup_over_torch_powersgd"] is None
    table = format_report(summary)
    assert table.count("not reached") == 4  # time and steps of both rows
    assert json.loads(json.dumps(summary))["rows"][1]["time_to_target_s"] is None


def test_speed_ups_compare_times_to_target():
    raw = {
        "target": 2.0,
        "rows": [
            {"method": m, "kind": k, "note": "", "bucket_cap_mb": None, "bytes_per_step": 1.0, "curve": c}
            for m, k, c in (
                ("ddp", "ddp", [(0, 0.0, 3.0), (10, 4.0, 2.0)]),
                ("torch-powersgd", "torch-powersgd", [(0, 0.0, 3.0), (10, 2.0, 2.5), (20, 3.0, 1.9)]),
                ("powersgd", "commpress", [(0, 0.0, 3.0), (10, 1.0, 1.5), (20, 2.0, 1.0)]),
            )
        ],
    }
    rows = summarize(raw)["rows"]
    assert [r["time_to_target_s"] for r in rows] == [4.0, 3.0, 1.0]
    assert [r["steps_to_target"] for r in rows] == [10, 20, 10]
    assert [r["speedup_over_ddp"] for r in rows] == [1.0, 4 / 3, 4.0]
    assert [r["speedup_over_torch_powersgd"] for r in rows] == [0.75, 1.0, 3.0]
    assert rows[2]["final_loss"] == 1.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "2", "--target-steps", "5"], "--target and --target-steps are not accepted together"),
        (["--target-steps", "10", "--max-steps", "5"], "--max-steps = 5 is not accepted"),
        (["--task", "nosuch"], "task = 'nosuch' is not accepted"),
        (["--width", "10", "--heads", "4"], "width = 10 is not accepted"),
        (["--methods", "nosuch"], "'nosuch' is neither a baseline nor a commpress method"),
    ],
)
def test_bad_command_lines_end_before_any_rank(argv, message, capsys):
    assert main(["race", "--local", "2", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_command_module_imports_torch_only_when_it_runs():
    """``commpress race --help`` parses without the command's own module loading torch or
    the race runner: those imports sit inside the functions that run."""
    tree = ast.parse((Path(__file__).parents[1] / "commpress" / "cli" / "race.py").read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in top if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "argparse", "functools", "os", "sys", "typing", "commpress.cli.ranks", "commpress.cmdline"}, (
        names
    )


def test_without_a_target_ddp_runs_first():
    with pytest.raises(ConfigError, match="the first method must be ddp"):
        RacePlan(methods=tuple(parse_methods("topk;ddp")))
    assert RacePlan(methods=tuple(parse_methods("topk;ddp")), target=2.0).target == 2.0


def test_the_time_cap_does_not_stop_the_reference_run(one_rank):
    """The target is ddp's loss after target_steps, whatever --max-seconds says; the cap
    stops the other rows."""
    summary = _race(target_steps=3, max_steps=6, max_seconds=1e-9)
    ddp, topk = summary["rows"]
    assert ddp["steps"] == 3 and summary["target_source"] == "ddp after 3 steps"
    assert topk["steps"] == 1  # stopped at its first evaluation, past the cap
