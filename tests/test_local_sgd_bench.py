"""Local SGD and CO2 configs as rows of ``commpress bench`` (2 gloo ranks, tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from commpress.bench.launch import run_local
from commpress.bench.methods import method_from_config, parse_methods
from commpress.bench.runner import BenchPlan, bench_rank

pytestmark = pytest.mark.multiproc
CONFIGS = Path(__file__).resolve().parent.parent / "docs" / "configs"


@pytest.mark.parametrize("interleave", [False, True])
def test_local_sgd_rows_send_a_fraction_of_ddp_bytes(interleave):
    methods = (
        *parse_methods("ddp"),
        method_from_config(str(CONFIGS / "local_sgd_h4.toml")),
        method_from_config(str(CONFIGS / "co2_h4.toml")),
    )
    plan = BenchPlan(methods, workload="gpt2", scale=0.01, steps=8, warmup=4, progress=False, interleave=interleave)
    result = run_local(bench_rank, 2, plan)[0]
    ddp, local, co2 = result["ranks"][0]["methods"]
    assert [m["label"] for m in (local, co2)] == ["local_sgd_h4", "co2_h4"]
    # 4 warm-up steps (one round, not counted), then 8 timed steps = 2 rounds of 4
    assert local["bytes_sent"] == co2["bytes_sent"] == 2 * result["workload"]["grad_bytes"]
    assert ddp["bytes_sent"] == 8 * result["workload"]["grad_bytes"]
    assert len(local["step_seconds"]) == len(co2["step_seconds"]) == 8
    assert len(set(local["step_seconds"][:4])) == 1  # a round's time is spread over its steps
