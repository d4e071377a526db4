"""What ``commpress bandwidth`` prints: no conclusion a loss difference inside the noise
cannot support, and with ``--measure-only`` only what was measured and planned."""

from __future__ import annotations

import pytest

from commpress.cli import main
from commpress.cli.bandwidth import LOSS_MARGIN, loss_order, render, render_groups


def _row(label: str, ms: float, *losses: float) -> dict:
    seeds = [{"eval_loss": loss, "bytes_per_step": 1000.0, "step_seconds": ms / 1000} for loss in losses]
    return {
        "label": label,
        "bytes_per_step": 1000.0,
        "step_seconds": ms / 1000,
        "eval_loss": sum(losses) / len(losses),
        "seeds": seeds,
    }


def test_a_difference_inside_the_margin_is_no_difference():
    a, b = _row("adaptive topk", 50, 3.1602), _row("fp16", 100, 3.1603)
    assert loss_order(a, b) == 0
    text = render([b, a])
    assert "lower final loss than every" not in text
    assert (
        "adaptive topk: 2.00x the speed of fp16, the fastest global setting whose final loss is not measurably higher "
        "(the difference is not measurable)"
    ) in text
    assert f"(final losses differ measurably when more than {100 * LOSS_MARGIN:g}% apart; --seeds 3 weighs" in text


def test_a_clear_difference_is_named():
    a = _row("adaptive topk", 50, 3.0)
    rows = [_row("fp16", 100, 3.2), _row("topk", 40, 3.3), a]
    assert loss_order(a, rows[0]) == 1 and loss_order(rows[0], a) == -1
    assert "adaptive topk: measurably lower final loss than every global setting" in render(rows)
    rows.insert(0, _row("none", 200, 2.9))
    assert "4.00x the speed of none, the fastest global setting whose final loss is not measurably higher (none's is" in render(
        rows
    )


def test_seeds_whose_differences_disagree_show_no_difference():
    """Over 3% apart on average, but one seed says the opposite: the spread over seeds wins."""
    a, b = _row("adaptive powersgd", 50, 2.00, 2.10, 2.00), _row("fp16", 100, 2.15, 2.00, 2.20)
    assert loss_order(a, b) == 0
    assert "% apart, beyond the seed-by-seed spread of their difference)" in render([b, a])
    c = _row("topk", 40, 2.30, 2.35, 2.25)  # above on every seed, by more than the spread
    assert loss_order(a, c) == 1


def test_only_global_rows_draw_no_conclusion():
    text = render([_row("fp16", 100, 3.2), _row("topk", 40, 3.3)])
    assert "adaptive" not in text and "measurabl" not in text


def test_group_table_has_every_column_filled():
    groups = [
        {"group": "cross 0", "ranks": [0, 2], "method": "topk ratio=0.02", "predicted_bytes": 75608, "predicted_seconds": 0.002}
        | {"measured_bytes": 75608, "measured_seconds": 0.004, "steps": 10}
    ]
    lines = render_groups("adaptive topk", groups).splitlines()
    assert lines[-1].split() == ["cross", "0", "0", "2", "topk", "ratio=0.02", "75,608", "75,608", "2.00", "4.00", "2.00"]


@pytest.mark.multiproc
def test_measure_only_prints_the_topology_and_plans_and_no_empty_table(capfd):
    assert main(["bandwidth", "--local", "2", "--measure-only", "--probe-ms", "5", "--adaptive", "topk", "--budgets", "0"]) == 0
    out = capfd.readouterr().out
    assert "topology: 2 ranks" in out
    assert "plan for adaptive topk on the demo model (predicted from the measured links):" in out
    assert "ms meas" not in out and not any(cell == "-" for line in out.splitlines() for cell in line.split())
