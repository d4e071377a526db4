"""The CPU throughput tool: every row measured against copy_ on each thread count, buckets as DDP forms them."""

import pytest
import torch

from commpress.bench import throughput


def test_buckets_are_filled_up_to_the_cap_in_order():
    sizes = throughput.equal_sizes(10, 3)
    assert sizes == [4, 3, 3]  # 16, 12, 12 bytes
    assert throughput._buckets(sizes, 16) == [[("t0", 0, 4)], [("t1", 4, 3)], [("t2", 7, 3)]]
    assert throughput._buckets(sizes, 28) == [[("t0", 0, 4), ("t1", 4, 3)], [("t2", 7, 3)]]
    assert throughput._buckets(sizes, 8) == [[("t0", 0, 4)], [("t1", 4, 3)], [("t2", 7, 3)]]  # too big: alone
    assert throughput._buckets(sizes, 1 << 20) == [[("t0", 0, 4), ("t1", 4, 3), ("t2", 7, 3)]]


def test_every_row_on_every_thread_count():
    methods = ["terngrad", "topk:ratio=0.1", "fp16"]
    before = torch.get_num_threads()
    sizes = throughput.equal_sizes(6000, 3)
    rows = throughput.measure(sizes, threads=[1, 2], repeat=1, bucket_mb=0.01, methods=methods, qsdp=[(4, 64)])
    assert torch.get_num_threads() == before
    names = ["copy_", *methods, "qsdp 4-bit B=64"]
    assert [(r["threads"], r["method"]) for r in rows] == [(t, name) for t in (1, 2) for name in names]
    assert all(r[key] > 0 for r in rows for key in ("compress", "decompress", "copy"))
    copies = [r for r in rows if r["method"] == "copy_"]
    assert all(r["compress"] == r["decompress"] == r["copy"] for r in copies)
    text = throughput.table(rows)
    header = "method threads compress GB/s vs copy decompress GB/s vs copy"
    assert " ".join(text.splitlines()[0].split()) == header
    assert "100%" in text and "qsdp 4-bit B=64" in text


def test_main_names_the_cpu_backend_and_openmp_wait(capsys, monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    throughput.main(["--numel", "4000", "--repeat", "1", "--threads", "1", "--methods", "terngrad", "--bucket-mb", "0.01"])
    out = capsys.readouterr().out
    assert out.startswith("CPU backend: numba ") and "4,000 float32 elements in 4 tensors, 2 buckets;" in out
    assert "OpenMP wait: GOMP_SPINCOUNT=10000" in out.splitlines()[0]
    assert "terngrad" in out and "qsdp 8-bit B=1024" in out


def test_workload_shapes():
    sizes = throughput.workload_sizes("gpt2", 0.01)
    assert len(sizes) > 50 and min(sizes) < 100 < 10_000 < max(sizes)  # many small tensors, a few large ones
    throughput.main(["--workload", "gpt2", "--scale", "0.01", "--repeat", "1", "--threads", "1", "--methods", "terngrad"])


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        throughput.main(["--threads", "0,2"])
    assert "argument --threads: '0' is not accepted; expected an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput.main(["--numel", "0"])
    assert "argument --numel: '0' is not accepted; expected an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput.main(["--scale", "2"])
    assert "argument --scale: '2' is not accepted; expected a number in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput.main(["--repeat", "0"])
    assert "argument --repeat: '0' is not accepted; expected an integer >= 1" in capsys.readouterr().err
