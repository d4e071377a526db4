"""The quality suite (``commpress quality``) on a tiny configuration: every requested row is
there, ``none`` is its own reference, rows that cannot run say why, the command line."""

from __future__ import annotations

import math

import pytest
import torch

from commpress.bench import quality, simulated_training
from commpress.bench.optimizers import make_optimizer
from commpress.bench.quality import METHODS, QualityRun, run_suite, train
from commpress.bench.quality_report import render, summarize
from commpress.cli import main
from commpress.comm import SimulatedWorld
from commpress.config import Config
from commpress.config.groups import last_layer_names
from commpress.errors import ConfigError
from commpress.workloads.synthetic import ShapesTask


@pytest.fixture(scope="module")
def tiny():
    runs = run_suite(["charlm", "shapes", "transformer"], ["sgd", "adamw"], ["topk-dgc", "local-sgd+qsr", "co2"], [0, 1], steps=3)
    return runs, summarize(runs)


def test_every_requested_row_and_none_is_exactly_its_own_reference(tiny):
    runs, rows = tiny
    keys = [(r.task, r.optimizer, r.method) for r in rows]
    assert keys == [
        (t, o, m)
        for t in ("charlm", "shapes", "transformer")
        for o in ("sgd", "adamw")
        for m in ("none", "topk-dgc", "local-sgd+qsr", "co2")
    ]
    assert len(runs) == 3 * 2 * 4 * 2  # two seeds of each
    for row in rows:
        if row.method == "none":
            assert row.gap_mean == row.gap_min == row.gap_max == 0.0 and row.error is None
        elif row.error is None:
            assert math.isfinite(row.loss) and math.isfinite(row.gap_mean) and row.gap_min <= row.gap_mean <= row.gap_max
            assert row.bytes_per_step > 0
    text = render(rows, seeds=2)
    assert text.count("\n") >= len(rows) + 1 and "min .. max (2 seeds)" in text


def test_dgc_with_adamw_is_not_available_and_says_why(tiny):
    _, rows = tiny
    for row in (r for r in rows if r.method == "topk-dgc"):
        if row.optimizer == "adamw":
            assert math.isnan(row.loss) and "optimizer AdamW is not accepted" in row.error
        else:
            assert row.error is None and math.isfinite(row.loss)
    text = render(rows, seeds=2)
    assert "n/a (charlm/adamw/topk-dgc, shapes/adamw/topk-dgc, transformer/adamw/topk-dgc): optimizer AdamW" in text


def test_runs_are_deterministic_and_seeds_differ():
    a = train("shapes", "sgd", "topk", 0, 3)
    assert a == train("shapes", "sgd", "topk", 0, 3)
    assert a.eval_loss != train("shapes", "sgd", "topk", 1, 3).eval_loss


def test_every_row_runs_and_counts_its_bytes():
    torch.set_num_threads(1)
    runs = {m: train("shapes", "adamw" if m == "onebit-adam" else "sgd", m, 0, 2) for m in METHODS}
    assert all(isinstance(r, QualityRun) and r.error is None and math.isfinite(r.eval_loss) for r in runs.values())
    full = runs["none"].bytes_per_step
    # onebit-adam in 2 steps: 15% warm-up rounds to one exact step, then every tensor's momentum
    # in signs (ceil(n/8) bytes) and a scale per 64 elements, the bucket's finiteness flag aside
    model = ShapesTask(seed=0).model()
    frozen = sum((p.numel() + 7) // 8 + 4 * ((p.numel() + 63) // 64) for p in model.parameters())
    assert runs["onebit-adam"].bytes_per_step == (full + frozen) / 2
    assert runs["fp16"].bytes_per_step == runs["bf16"].bytes_per_step == full / 2
    assert runs["topk"].bytes_per_step == runs["topk-dgc"].bytes_per_step < full / 10
    # the low-rank rows average plainly before start_iter = steps // 10 = 0 here: compressed from the start
    assert runs["powersgd"].bytes_per_step < full / 4
    # terngrad-last: the last layer's tensors go in float32 (4 bytes per element) instead of
    # ceil(n/4) + 4 bytes each; its loss differs from terngrad's
    model = ShapesTask(seed=0).model()
    last = [p.numel() for n, p in model.named_parameters() if n in last_layer_names(model)]
    assert last_layer_names(model) == ["head.2.weight", "head.2.bias"]
    moved = sum(4 * n - ((n + 3) // 4 + 4) for n in last)
    assert runs["terngrad-last"].bytes_per_step == runs["terngrad"].bytes_per_step + moved
    assert runs["terngrad-last"].eval_loss != runs["terngrad"].eval_loss
    # co2 in 2 steps: one round (capped at the last step), its model difference averaged once in bf16
    assert runs["co2"].bytes_per_step == 1 * (full / 4) * 2 / 2
    # qsdp, 1 byte an element: a rank's half shard twice (forward and backward all-gathers) and
    # both halves in the reduce-scatter, about half of none's fp32 bytes, plus the buckets' scales
    # and the excluded tensors in fp32 (tests/test_quality_qsdp.py: the exact count of FSDP2)
    assert full / 2 < runs["qsdp-w8g8"].bytes_per_step < 0.6 * full
    assert runs["qsdp-w8g8"].eval_loss != runs["none"].eval_loss


def test_an_fsdp_table_with_another_method_is_not_available_and_says_why():
    run = train("shapes", "sgd", "qsdp+topk", 0, 1, config={"method": "topk", "fsdp": {"weight_bits": 8}})
    assert math.isnan(run.eval_loss) and "applies [fsdp] only" in run.error and "the config's method cannot apply" in run.error


def test_co2_row_runs_the_real_co2_on_every_rank():
    """CO2 applies a round's average one round late: after the first round every rank is
    back at the initial model; after ``finish`` the ranks hold one model (averaged), not
    the initial one; bytes: 3 averagings (rounds of 5, 5 and 2 steps) in bf16."""
    steps, spec = 12, quality.TASKS["shapes"]
    task = spec.make(0)
    cfg = Config.load(quality.method_config("co2", spec.lr["sgd"], steps))
    models = [task.model() for _ in range(simulated_training.WORLD)]
    opts = [make_optimizer("sgd", m, spec.lr["sgd"]) for m in models]
    start = [p.detach().clone() for p in models[0].parameters()]
    sim = SimulatedWorld(simulated_training.WORLD)
    step_fn = simulated_training.OuterRanks(cfg, models, opts, sim, steps)
    for step in range(steps):
        grads = []
        for r, model in enumerate(models):
            x, y = task.batch(step, r, simulated_training.WORLD)
            grads.append(torch.autograd.grad(spec.loss(model(x), y), list(model.parameters())))
        step_fn(step, grads)
        if step == 4:  # the first sync point: nothing to apply yet, the models restart from the anchor
            assert all(torch.equal(p, q) for m in models for p, q in zip(m.parameters(), start))
    step_fn.finish()
    assert [t.clock.rounds for t in step_fn.trainers] == [3, 3]
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(models[0].parameters(), start))
    numel = sum(p.numel() for p in start)
    assert sim.traffic[0].bytes_sent == 3 * numel * 2


def test_co2_adaptive_penalty_in_one_process_is_refused():
    """Its blocking all-reduce would wait forever for the ranks that run after this one."""
    spec = quality.TASKS["shapes"]
    cfg = Config.load({"method": "none", "local_sgd": {"algorithm": "co2", "period": 5, "staleness_penalty": "adaptive"}})
    models = [spec.make(0).model() for _ in range(simulated_training.WORLD)]
    opts = [make_optimizer("sgd", m, 0.1) for m in models]
    with pytest.raises(ConfigError, match="staleness_penalty = 'adaptive' is not accepted with ranks simulated in one process"):
        simulated_training.OuterRanks(cfg, models, opts, SimulatedWorld(simulated_training.WORLD), 10)


def test_command_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "q.png"
    argv = ["quality", "--tasks", "shapes", "--optimizers", "sgd", "--methods", "bf16;topk:ratio=0.05"]
    assert main([*argv, "--seeds", "1", "--steps", "2", "--quiet", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert [line.split()[2] for line in out.splitlines()[2:]] == ["none", "bf16", "topk:ratio=0.05"]
    assert png.stat().st_size > 1000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "mnist"], "--tasks: 'mnist' is not accepted; accepted: charlm, shapes, transformer, resnet"),
        (["--optimizers", "lion"], "--optimizers: 'lion' is not accepted; accepted: sgd, adamw"),
        (["--methods", "topk:ratio=2"], "method 'topk:ratio=2' is neither a row"),
        (["--methods", " ; "], "argument --methods: ' ; ' names no method"),
        (["--seeds", "0"], "argument --seeds: '0' is not accepted; expected an integer >= 1"),
    ],
)
def test_command_line_errors(args, message, capsys):
    assert main(["quality", "--steps", "1", *args]) == 2
    assert message in capsys.readouterr().err


def test_the_catalog_names_every_task_in_order():
    """``commpress quality --help`` lists the tasks from the torch-free catalog."""
    from commpress.bench import catalog

    assert tuple(quality.TASKS) == catalog.TASKS


def test_muon_steps_the_hidden_matrices_and_adamw_the_rest():
    from commpress.bench.optimizers import muon_split
    from commpress.workloads.synthetic import CharTransformerTask

    model = CharTransformerTask(seed=0).model()
    matrices, rest = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in matrices} == {n for n, p in model.named_parameters() if p.ndim == 2} - {
        "embed.weight",
        "position.weight",
        "head.weight",
    }
    assert len(matrices) + len(rest) == len(list(model.parameters()))
    opt = make_optimizer("muon", model, 2e-3, rest_lr=1e-3)
    simulated_training.set_lr(opt, 1e-4)
    assert [g["lr"] for g in opt.param_groups] == [1e-4, 1e-4 * 0.5]


def test_muon_rows_run_and_one_adamw_rows_say_why_not():
    none, diloco = train("charlm", "muon", "none", 0, 3), train("charlm", "muon", "diloco", 0, 3)
    assert math.isfinite(none.eval_loss) and math.isfinite(diloco.eval_loss) and diloco.bytes_per_step > 0
    assert none.eval_loss != train("charlm", "adamw", "none", 0, 3).eval_loss
    onebit = train("charlm", "muon", "onebit-adam", 0, 3)
    assert math.isnan(onebit.eval_loss) and "HybridOptimizer of Float32Muon over" in onebit.error
