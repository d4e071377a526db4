"""``commpress race``: a short real race on 2 ranks, the JSON it writes, each row's two
factors and the ceiling computed from the measured figures, methods that never reach the
target (reported with their best loss, not dropped), and the command line's checks."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch.distributed as dist

from commpress.bench.methods import parse_methods
from commpress.bench.race import RacePlan, RaceTask, race_rank
from commpress.bench.race_report import crossing, format_report, reference_target, summarize
from commpress.cli import main
from commpress.errors import ConfigError

#: a transformer small enough for a few steps on 2 cores
TINY = ["--width", "16", "--layers", "1", "--heads", "2", "--context", "16", "--batch", "4", "--eval-size", "16"]
ROW_FIELDS = {
    "method",
    "time_to_target_s",
    "steps_to_target",
    "final_loss",
    "best_loss",
    "bytes_per_step",
    "steps_vs_ddp",
    "step_time_vs_ddp",
    "curve",
}


def test_two_ranks_race_end_to_end(tmp_path, capsys):
    out, plot = tmp_path / "race.json", tmp_path / "race.png"
    methods = "torch-powersgd:rank=2;powersgd:rank=2;ddp"  # ddp moves first: it sets the target
    argv = ["race", "--local", "2", *TINY, "--target-steps", "4", "--eval-every", "2", "--warmup", "1", "--compute-steps", "3"]
    argv += ["--smooth", "3"]
    assert main([*argv, "--methods", methods, "--json", str(out), "--plot", str(plot), "--quiet"]) == 0
    report = json.loads(out.read_text())
    _check_factors(report)
    table = capsys.readouterr().out
    assert all(
        h in table for h in ("steps / ddp's", "step time / ddp's", "computation alone", f"ceiling {report['ceiling']:.2f}x")
    )
    assert {"target", "link", "rows"} <= set(report) and report["world_size"] == 2
    assert [r["method"] for r in report["rows"]] == ["ddp", "torch-powersgd:rank=2", "powersgd:rank=2"]
    assert all(set(r) >= ROW_FIELDS for r in report["rows"])
    ddp = report["rows"][0]  # ran one evaluation past step 4: the target is the mean of steps 2, 4 and 6
    assert ddp["steps"] == 6 and report["smooth"] == 3
    assert report["target"] == pytest.approx(sum(p["loss"] for p in ddp["curve"][1:4]) / 3)
    assert ddp["steps_to_target"] <= 4 and ddp["time_to_target_s"] > 0
    assert 0 < report["rows"][2]["bytes_per_step"] < ddp["bytes_per_step"] == report["task"]["grad_bytes"]
    assert report["rows"][1]["note"] == "1 bucket"
    assert all(r["curve"][0]["step"] == 0 and r["steps"] <= 8 for r in report["rows"])  # cap: twice the target steps
    assert plot.stat().st_size > 0


def _check_factors(report: dict) -> None:
    """Every factor and the ceiling are the ratios of the report's own measured figures."""
    compute = report["compute_only"]
    assert compute["seconds"] > 0 and report["compute_seconds_per_step"] == compute["seconds"] / compute["steps"]
    ddp = next(r for r in report["rows"] if r["kind"] == "ddp")
    assert report["ceiling"] == ddp["seconds_per_step"] / report["compute_seconds_per_step"]
    for r in report["rows"]:
        assert r["seconds_per_step"] == r["seconds"] / r["steps"]
        assert r["step_time_vs_ddp"] == r["seconds_per_step"] / ddp["seconds_per_step"]
        reached = r["steps_to_target"] is not None and ddp["steps_to_target"]
        assert r["steps_vs_ddp"] == (r["steps_to_target"] / ddp["steps_to_target"] if reached else None)
        assert r["best_loss"] == min(p["loss"] for p in r["curve"])


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
    summary = _race(target=0.01, max_steps=2, compute_steps=2)
    assert [r["method"] for r in summary["rows"]] == ["ddp", "topk:ratio=0.1"]
    for r in summary["rows"]:
        assert r["time_to_target_s"] is None and r["steps_to_target"] is None and r["steps"] == 2
        assert r["speedup_over_ddp"] is None and r["speedup_over_torch_powersgd"] is None and r["steps_vs_ddp"] is None
    _check_factors(summary)  # the step-time factor and the ceiling stand without a target reached
    table = format_report(summary)
    assert table.count("not reached") == 2  # the time cell of each row, with its best loss and steps
    for r in summary["rows"]:
        assert f"not reached (best {r['best_loss']:.3f} in 2 steps)" in table
    assert json.loads(json.dumps(summary))["rows"][1]["time_to_target_s"] is None


def _raw_row(method: str, kind: str, curve: list) -> dict:
    """A row as a race returns it, with ``curve``'s (step, seconds, loss) points."""
    return {"method": method, "kind": kind, "note": "", "bucket_cap_mb": None, "bytes_per_step": 1.0, "curve": curve}


def test_speed_ups_compare_times_to_target():
    raw = {
        "target": 2.0,
        "compute_only": {"steps": 10, "seconds": 1.0},
        "rows": [
            _raw_row(m, k, c)
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
    assert [r["steps_vs_ddp"] for r in rows] == [1.0, 2.0, 1.0]
    assert [r["step_time_vs_ddp"] for r in rows] == pytest.approx([1.0, 0.15 / 0.4, 0.1 / 0.4])
    assert summarize(raw)["ceiling"] == pytest.approx(0.4 / 0.1)
    # torch-powersgd stopped at the target: its speed-up is the product of its two factors
    assert rows[1]["speedup_over_ddp"] == pytest.approx(1 / (rows[1]["steps_vs_ddp"] * rows[1]["step_time_vs_ddp"]))


def test_without_a_ddp_row_there_are_no_factors_and_no_ceiling():
    raw = {
        "target": 2.0,
        "compute_only": {"steps": 10, "seconds": 1.0},
        "rows": [_raw_row("topk", "commpress", [(0, 0.0, 3.0), (10, 2.0, 1.9)])],
    }
    summary = summarize(raw)
    assert summary["ceiling"] is None and summary["compute_seconds_per_step"] == 0.1
    assert summary["rows"][0]["steps_vs_ddp"] is None and summary["rows"][0]["step_time_vs_ddp"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "2", "--target-steps", "5"], "--target and --target-steps are not accepted together"),
        (["--target-steps", "10", "--max-steps", "5"], "--max-steps = 5 is not accepted"),
        (["--task", "nosuch"], "task = 'nosuch' is not accepted"),
        (["--width", "10", "--heads", "4"], "width = 10 is not accepted"),
        (["--methods", "nosuch"], "'nosuch' is neither a baseline nor a commpress method"),
        (["--compute-steps", "0"], "'0' is not accepted; expected an integer >= 1"),
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
    allowed = {"__future__", "argparse", "functools", "os", "sys", "typing", "commpress.cli.ranks", "commpress.bench.arguments"}
    assert names <= allowed, names


def test_without_a_target_ddp_runs_first():
    with pytest.raises(ConfigError, match="the first method must be ddp"):
        RacePlan(methods=tuple(parse_methods("topk;ddp")))
    assert RacePlan(methods=tuple(parse_methods("topk;ddp")), target=2.0).target == 2.0
    with pytest.raises(ConfigError, match="compute_steps = 0 is not accepted"):
        RacePlan(methods=tuple(parse_methods("ddp")), compute_steps=0)


def test_the_time_cap_does_not_stop_the_reference_run(one_rank):
    """The target is ddp's loss after target_steps, whatever --max-seconds says; the cap
    stops the other rows."""
    summary = _race(target_steps=3, max_steps=6, max_seconds=1e-9, smooth=1)
    ddp, topk = summary["rows"]
    assert ddp["steps"] == 3 and summary["target_source"] == "ddp after 3 steps"
    assert topk["steps"] == 1  # stopped at its first evaluation, past the cap


def test_smoothed_crossings_are_not_moved_by_one_evaluation():
    """A dip of one evaluation crosses a single-point target early; the centred mean of 3
    does not, and the reference's target is its centred mean too."""
    losses = [3.0, 2.2, 1.5, 2.2, 2.0, 1.8, 1.7, 1.6]  # a dip at step 20, then a slow decline
    flat = [(10 * i, float(i), loss) for i, loss in enumerate(losses)]
    assert crossing(flat, 1.75) == 2 and crossing(flat, 1.75, smooth=3) == 6  # (1.8 + 1.7 + 1.6) / 3 at step 60
    assert crossing(flat, 1.85, smooth=3) == 5 and crossing(flat, 1.6, smooth=3) is None
    assert reference_target(flat, 50, smooth=3) == pytest.approx(5.5 / 3)
    assert reference_target(flat, 70) == 1.6
    with pytest.raises(ValueError, match="1 evaluations past step 70"):
        reference_target(flat, 70, smooth=3)
    raw = {"target": 1.6, "smooth": 3, "compute_only": {"steps": 1, "seconds": 1.0}, "rows": [_raw_row("ddp", "ddp", flat)]}
    assert summarize(raw)["rows"][0]["steps_to_target"] is None  # the centred means never get below 1.7
    raw["smooth"] = 1
    assert summarize(raw)["rows"][0]["steps_to_target"] == 20


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"smooth": 4}, "smooth = 4 is not accepted; expected an odd number"),
        ({"smooth": 0}, "smooth = 0 is not accepted"),
        ({"target_steps": 15, "eval_every": 10}, "target_steps = 15 is not accepted with smooth = 5"),
    ],
)
def test_smoothing_that_cannot_centre_on_the_target_is_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RacePlan(methods=tuple(parse_methods("ddp")), **kwargs)


def test_a_diverging_row_is_reported_and_the_race_goes_on(one_rank):
    """An outer step so large that the model overflows: DiLoCo's non-finite average stops
    that row, which the table marks diverged, and the next row still runs."""
    from commpress.bench.methods import BenchMethod
    from commpress.config import Config

    blowup = {"method": "none", "local_sgd": {"algorithm": "diloco", "period": 1, "outer_lr": 1e38, "outer_momentum": 0.0}}
    blowup["local_sgd"]["nesterov"] = False
    methods = (*parse_methods("ddp"), BenchMethod("blowup", "commpress", config=Config.from_dict(blowup)), *parse_methods("topk"))
    task = RaceTask("transformer", batch=4, context=16, width=16, layers=1, heads=2, eval_size=8)
    plan = RacePlan(methods=methods, task=task, target=0.01, max_steps=4, eval_every=1, warmup=2, progress=False, compute_steps=1)
    summary = summarize(race_rank(0, 1, plan))
    ddp, blown, topk = summary["rows"]
    assert blown["diverged"]["step"] <= 4 and "not finite" in blown["diverged"]["error"]
    assert ddp["diverged"] is None and topk["diverged"] is None and topk["steps"] == 4
    assert f"diverged at step {blown['diverged']['step']}" in format_report(summary)


def test_every_row_runs_to_the_end_of_ddps_run_and_is_compared_there(one_rank):
    """A row that reaches the target early still runs to target_steps: its loss there (the
    end of the decayed run) and its gap to ddp's stand beside its time to the target."""
    summary = _race(target_steps=6, max_steps=12, smooth=1, lr_warmup=1)
    ddp, topk = summary["rows"]
    assert summary["schedule"] == "lr 0.001: 1 warm-up steps, cosine to 0.0001 at step 6"
    assert ddp["loss_at_target_steps"] == summary["target"] == ddp["curve"][6]["loss"] and ddp["loss_vs_ddp"] == 0
    assert topk["steps"] >= 6 and topk["loss_at_target_steps"] == topk["curve"][6]["loss"]
    assert topk["loss_vs_ddp"] == pytest.approx(topk["loss_at_target_steps"] / ddp["loss_at_target_steps"] - 1)
    table = format_report(summary)
    assert "loss at 6" in table and f"{100 * topk['loss_vs_ddp']:+.2f}%" in table


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    from commpress.workloads.schedule import Schedule

    cosine = Schedule("cosine", 1.0, steps=10, warmup=4)
    assert [cosine(s) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert cosine(4) == 1.0 and cosine(7) == pytest.approx(0.55) and cosine(10) == cosine(50) == pytest.approx(0.1)
    assert all(cosine(s) > cosine(s + 1) for s in range(4, 10))
    assert {Schedule("constant", 0.5, steps=10)(s) for s in range(20)} == {0.5}
    with pytest.raises(ConfigError, match="schedule = 'linear' is not accepted; accepted: cosine, constant"):
        Schedule("linear", 1.0, steps=10)
    with pytest.raises(ConfigError, match="lr warm-up = 10 steps is not accepted"):
        RacePlan(methods=tuple(parse_methods("ddp")), target_steps=10, lr_warmup=10)
