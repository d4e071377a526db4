"""The kernel benchmark tool runs every op on a tiny buffer and reports consistent rows."""

import torch

from commpress.bench import kernels as bench


def test_bench_measures_every_op_against_copy(capsys):
    rows = bench.measure(4096, torch.device("cpu"), repeat=1)
    names = [r["op"] for r in rows]
    assert names[0] == "copy" and len(names) == len(set(names)) == len(bench.BYTES)
    assert all(r["ms"] > 0 and r["GB/s"] > 0 for r in rows)
    assert rows[0]["vs copy"] == 1.0 and rows[0]["of byte limit"] == 1.0
    with_torch = [r for r in rows if r["speed-up"] is not None]
    assert {r["op"] for r in with_torch} >= {"uniform", "ternary_quantize_pack", "topk_select 1%"}
    bench.main(["--numel", "2048", "--repeat", "1"])
    out = capsys.readouterr().out
    assert "| copy |" in out and "2,048 float32 elements on CPU" in out
