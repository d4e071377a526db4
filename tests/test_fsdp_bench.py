"""``commpress bench-fsdp``: row parsing, validation and the table (the runs themselves
are the same ``train_fsdp`` the multi-rank FSDP tests exercise)."""

from __future__ import annotations

import pytest

from commpress import ConfigError
from commpress.cli import main
from commpress.cli.bench_fsdp import FSDP_ROWS, parse_rows, render


def test_rows():
    rows = parse_rows("fsdp; q4:weight_bits=4,grad_bits=4,exclude=['*norm*']")
    assert rows[0].label == "fsdp" and rows[0].config == {"weight_bits": 32, "grad_bits": 32}
    assert rows[1].label == "q4"
    assert rows[1].config == {"weight_bits": 4, "grad_bits": 4, "exclude": ["*norm*"]}
    assert FSDP_ROWS[0].config == rows[0].config  # the default reference counts plain collectives


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("q:weight_bits=3", "fsdp.weight_bits = 3 is not accepted"),
        ("q:bits=8", "fsdp: unknown key 'bits'; accepted keys: bucket_size, exclude"),
        ("q:weight_bits", "is not key=value"),
        (" ; ", "names no row"),
        ("q4", "'q4' is no default row"),
        ("fsdp,q:weight_bits=4;fsdp", "'fsdp' is named twice"),
    ],
)
def test_bad_rows(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_rows(text)


def test_bad_arguments_fail_before_starting_ranks(capsys):
    assert main(["bench-fsdp", "--local", "2", "--steps", "3"]) == 2
    assert "--steps: '3' is not accepted" in capsys.readouterr().err
    assert main(["bench-fsdp", "--local", "4", "--mesh", "2x2"]) == 2
    assert "--mesh = '2x2' is not accepted" in capsys.readouterr().err


def test_table_compares_with_the_first_row():
    results = [
        {"label": "fsdp", "gather_bytes": 800.0, "scatter_bytes": 400.0, "step_seconds": 0.1, "eval_loss": 2.0},
        {"label": "qsdp", "gather_bytes": 200.0, "scatter_bytes": 100.0, "step_seconds": 0.05, "eval_loss": 2.02},
    ]
    lines = render(results).splitlines()
    assert lines[0].split()[0] == "method"
    assert lines[3].split() == ["qsdp", "200", "100", "4.00x", "50.0", "2.0200", "+1.00%"]
