"""What layer-wise planning costs: the Top-k errors found without a sort equal the sorted
definition, the top singular values found by a block power iteration bound the exact ones,
a large tensor measured on a sample of its rows errs by a few percent, and a
``[layerwise]`` row of ``commpress bench`` (2 gloo ranks) counts its measured steps, plans
and seconds into the table and the JSON."""

from __future__ import annotations

import json
import math

import pytest
import torch

from commpress.bench.launch import run_local
from commpress.bench.methods import method_from_config, parse_methods
from commpress.bench.report import format_report, summarize, write_json
from commpress.bench.runner import BenchPlan, bench_rank
from commpress.compressors import build
from commpress.compressors.tensor_stats import _sorted_sums, top_singular, top_sums
from commpress.layerwise import measure as layer_errors
from commpress.layerwise.measure import candidates, sample_rows, tensor_errors


def _largest(values: torch.Tensor, k: int) -> float:
    """The definition: the k largest, summed in float64 after a full sort."""
    return float(values.double().sort(descending=True).values[:k].sum())


@pytest.mark.parametrize("seed", range(8))
def test_top_sums_equal_the_sorted_sums(seed):
    """The radix selection (CPU) and the sort (CUDA) give the sums of the k largest: on
    values spread over many magnitudes, with many ties (the k-th largest has copies on both
    sides of k), with zeros and subnormals."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 5000, (1,), generator=g))
    values = (torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 8).square()
    if seed % 4 == 1:
        values = torch.randint(0, 4, (n,), generator=g).float()
    if seed % 4 == 2:
        values[: n // 2] = 0.0
        values[n // 2 :: 3] = 1e-41  # subnormal
    counts = sorted({int(k) for k in torch.randint(1, n + 1, (8,), generator=g)} | {1, n})
    for sums in (top_sums(values, counts), _sorted_sums(values, counts)):
        assert list(sums) == counts
        for k in counts:
            assert math.isclose(sums[k], _largest(values, k), rel_tol=1e-12, abs_tol=1e-300), (k, n)


def test_topk_errors_keep_their_definition():
    """Every Top-k candidate of ratio 0.01 (and DGC's, up to every entry): energy less the
    k largest squares, as the sorted definition gives it; fp16 and none unchanged."""
    torch.manual_seed(0)
    acc = torch.randn(300, 70) * torch.rand(300, 1)  # rows of different scales
    flat = acc.reshape(-1).double()
    squares = flat.square()
    for params in ({"ratio": 0.01, "min_numel": 0}, {"ratio": 0.01, "dgc": True, "min_numel": 0}):
        settings = candidates("topk", params)
        methods = [build(m, p) for m, p in settings]
        errors = tensor_errors(methods, (300, 70), acc.reshape(-1))
        for (method, p), e in zip(settings, errors):
            if method == "topk":
                k = min(flat.numel(), max(1, math.ceil(p["ratio"] * flat.numel())))
                expected = max(0.0, float(squares.sum()) - _largest(squares, k))
                # float32 squares summed in float64, against float64 squares
                assert math.isclose(e, expected, rel_tol=1e-5, abs_tol=1e-12 * float(squares.sum())), p
            elif method == "none":
                assert e == 0.0
            else:
                assert e > 0  # fp16 rounds
    nan = acc.reshape(-1).clone()
    nan[5] = math.nan  # a non-finite step (discarded later) is measured without raising
    tensor_errors([build("topk", {"ratio": 0.1, "min_numel": 0})], (300, 70), nan)


def _gradient_like(n: int, m: int, rank: int, seed: int) -> torch.Tensor:
    """A matrix of low rank plus noise, rows of different scales: what a layer's gradient
    looks like to the error models."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(n, rank, generator=g) @ torch.randn(rank, m, generator=g)
    return (low + 0.3 * torch.randn(n, m, generator=g)) * torch.rand(n, 1, generator=g)


def test_top_singular_values_bound_the_exact_ones_from_below():
    """Past the exact size, the Ritz values of the power iteration are at most the true
    singular values, so the error read off them (energy less the top r) bounds the best
    rank-r error from above, within 1% for every rank asked for; the same values on every
    call."""
    a = _gradient_like(600, 200, 6, seed=0)
    exact = torch.linalg.svdvals(a.double())
    found = top_singular(a, 8)
    assert len(found) >= 8 and len(found) < len(exact)  # the iteration, not svdvals
    assert torch.all(found <= exact[: len(found)] * (1 + 1e-6))
    assert torch.allclose(found[:6], exact[:6], rtol=1e-4)  # the low-rank part: converged
    energy = float(a.double().square().sum())
    for r in range(1, 9):
        best = float(exact[r:].square().sum())
        read = energy - float(found[:r].square().sum())
        assert best * (1 - 1e-6) <= read <= best * 1.01, r
    assert torch.equal(found, top_singular(a, 8))
    small = _gradient_like(40, 30, 3, seed=1)  # smaller side <= 4x the rank: exact
    assert torch.allclose(top_singular(small, 8), torch.linalg.svdvals(small.double()))


def test_a_large_tensor_is_measured_on_a_sample_of_its_rows(monkeypatch):
    """A tensor above SAMPLE elements is measured on every t-th row, its errors scaled by
    the tensor's energy over the rows'; each candidate's error (Top-k densities, onebit,
    quant, TernGrad, fp16; low ranks are read off the whole matrix) is within 12% of the
    error measured on the whole tensor; a small, 1-D or few-row tensor is measured whole."""
    acc = _gradient_like(1024, 256, 6, seed=2).reshape(-1)
    rows, factor, energy = sample_rows(acc, (1024, 256))
    assert torch.equal(rows, acc.view(1024, 256)[::4].reshape(-1)) and rows.numel() <= layer_errors.SAMPLE
    assert math.isclose(factor, float(acc.double().square().sum() / rows.double().square().sum()), rel_tol=1e-9)
    assert math.isclose(energy, float(acc.double().square().sum()), rel_tol=1e-9)  # found once, reused
    for shape in ((acc.numel(),), (8, acc.numel() // 8), (64, 256)):  # 1-D, 8 rows, small
        whole = acc[: math.prod(shape)]
        assert sample_rows(whole, shape)[0] is whole
    settings = [*candidates("topk", {"ratio": 0.01}), *candidates("powersgd", {"rank": 4})]
    methods = [build(m, p) for m, p in settings]
    sampled = tensor_errors(methods, (1024, 256), acc)
    monkeypatch.setattr(layer_errors, "SAMPLE", acc.numel())
    exact = tensor_errors(methods, (1024, 256), acc)
    for (method, p), s, e in zip(settings, sampled, exact):
        tol = 1e-9 if method == "powersgd" else 0.12  # low rank: the same whole-matrix values
        assert math.isclose(s, e, rel_tol=tol, abs_tol=1e-12 * max(exact)), (method, p, s, e)


def _raw_row(label, layerwise, steps):
    return {
        "label": label,
        "kind": "commpress",
        "note": "",
        "bucket_cap_mb": None,
        "step_seconds": steps,
        "bytes_sent": 100,
        "collectives": 1,
        "compute_seconds": 0.0,
        "layerwise": layerwise,
    }


def test_planning_cost_is_averaged_over_ranks_and_amortised_over_every():
    def cost(measure, plan, timed_measure, timed_plan):
        return {
            "every": 10,
            "run": {"measured_steps": 2, "measure_seconds": measure, "plans": 2, "plan_seconds": plan},
            "timed": {"measured_steps": 1, "measure_seconds": timed_measure, "plans": 1, "plan_seconds": timed_plan},
        }

    raw = {
        "workload": {"name": "gpt2", "scale": 0.1, "batch": 8, "numel": 25, "grad_bytes": 100},
        "world_size": 2,
        "steps": 4,
        "warmup": 2,
        "ranks": [
            {"rank": 0, "compute_seconds": [0.1] * 4, "methods": [_raw_row("lw", cost(0.4, 0.2, 0.2, 0.1), [1.0] * 4)]},
            {"rank": 1, "compute_seconds": [0.1] * 4, "methods": [_raw_row("lw", cost(0.8, 0.2, 0.4, 0.1), [1.0] * 4)]},
        ],
    }
    p = summarize(raw)["methods"][0]["layerwise"]
    assert (p["measured_steps"], p["plans"], p["timed_plans"]) == (2, 2, 1)
    assert p["measure_seconds_per_plan"] == pytest.approx(0.3)  # mean over ranks 0.6 s, 2 measured steps
    assert p["plan_seconds_per_plan"] == pytest.approx(0.1)
    assert p["amortised_share"] == pytest.approx(0.4 / (10 * 1.0))  # one plan per 10 median steps of 1 s
    assert p["timed_seconds"] == pytest.approx(0.4) and p["timed_share"] == pytest.approx(0.4 / 4.0)
    assert "10.00% of the timed steps' time" in format_report(summarize(raw))


@pytest.mark.multiproc
def test_a_layerwise_row_reports_its_planning_cost(tmp_path):
    config = tmp_path / "planned.toml"
    config.write_text('method = "topk"\n[params]\nratio = 0.05\n[layerwise]\nenabled = true\nevery = 2\n')
    methods = (*parse_methods("topk:ratio=0.05"), method_from_config(str(config)))
    plan = BenchPlan(methods, workload="gpt2", scale=0.01, steps=4, warmup=2, progress=False)
    raw = run_local(bench_rank, 2, plan)[0]
    summary = summarize(raw)
    plain, planned = summary["methods"]
    assert plain["layerwise"] is None and planned["note"] == "layer-wise, planned every 2 steps"
    p = planned["layerwise"]
    # steps 0-5: measured at 0, 2, 4 and planned at 1, 3, 5; timed from step 2 on
    assert (p["measured_steps"], p["plans"], p["timed_measured_steps"], p["timed_plans"]) == (3, 3, 2, 2)
    assert p["measure_seconds_per_plan"] > 0 and p["plan_seconds_per_plan"] > 0
    assert 0 < p["timed_share"] < 1 and p["amortised_share"] > 0
    for rank in raw["ranks"]:  # every rank counted its own
        run = rank["methods"][1]["layerwise"]["run"]
        assert (run["measured_steps"], run["plans"]) == (3, 3) and run["measure_seconds"] > 0
    text = format_report(summary)
    assert "planned (layer-wise, planned every 2 steps)" in text
    assert "layer-wise planning of planned:" in text and "layer-wise planning of topk" not in text
    out = tmp_path / "bench.json"
    write_json(summary, str(out))
    rows = json.loads(out.read_text())["methods"]
    assert rows[0]["layerwise"] is None and rows[1]["layerwise"]["plans"] == 3
