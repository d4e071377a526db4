"""The demo rows of Local SGD + QSR and CO2 (DDP model, 2 gloo ranks, cosine schedule, 200
steps): final loss within 5% of synchronous DDP with at least 4x fewer bytes."""

from __future__ import annotations

import pytest
import torch

from commpress.bench.launch import run_local
from commpress.cli.demo import DEMO_ROWS

pytestmark = pytest.mark.multiproc
ROWS = {row.label: row.config for row in DEMO_ROWS if row.label in ("none", "local-sgd+qsr", "co2")}


def _train(rank: int, world: int) -> dict:
    from commpress.workloads.train import train_ddp

    return {label: train_ddp(config, steps=200, return_params=True) for label, config in ROWS.items()}


@pytest.fixture(scope="module")
def runs():
    return run_local(_train, 2)


@pytest.mark.parametrize("label", ["local-sgd+qsr", "co2"])
def test_demo_row_matches_ddp_with_4x_fewer_bytes(runs, label):
    ref, ours = runs[0]["none"], runs[0][label]
    assert ours.eval_loss <= 1.05 * ref.eval_loss
    assert ours.bytes_per_step * 4 <= ref.bytes_per_step
    assert torch.equal(ours.params, runs[1][label].params)  # finish() leaves every rank identical
    assert ours.state["rounds"] == len(ours.state["periods"]) and len(ours.state["wait_seconds"]) >= ours.state["rounds"]
