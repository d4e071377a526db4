"""``commpress bench``: method lists, shaped workloads, launcher detection, the report, and
one real 2-rank run of every kind of row."""

from __future__ import annotations

import json
import math

import pytest
import torch

from commpress.bench.launch import run_local
from commpress.bench.methods import default_methods, parse_methods
from commpress.bench.report import LOOPBACK_NOTE, format_report, summarize, write_plot
from commpress.bench.runner import BenchPlan, bench_rank
from commpress.cli import main
from commpress.comm.from_env import detect_launcher
from commpress.compressors import available
from commpress.errors import ConfigError
from commpress.workloads.shaped import SHAPE_SETS, ShapedTask, load_shapes, scale_shapes


def test_parse_methods_kinds_and_params():
    rows = parse_methods("ddp,torch-fp16,torch-powersgd:rank=2,start_iter=3,fp16:start_iter=1")
    assert [r.kind for r in rows] == ["ddp", "torch-fp16", "torch-powersgd", "commpress"]
    assert rows[2].params == {"rank": 2, "start_iter": 3, "min_compression_rate": 2.0}
    assert rows[2].note == "1 bucket"
    assert rows[3].config.method == "fp16" and rows[3].config.start_iter == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nosuch", r"'nosuch' is neither a baseline nor a commpress method; accepted: ddp, torch-fp16, torch-powersgd"),
        ("torch-powersgd:rank=0", r"rank = 0 is not accepted"),
        ("torch-powersgd:start_iter=1", r"start_iter = 1 is not accepted"),
        ("torch-powersgd:bogus=1", r"unknown key 'bogus'"),
        ("ddp:x=1", r"unknown key 'x'"),
        ("fp16;fp16", r"'fp16' is named twice"),
        ("fp16,start_iter=2", r"setting 'start_iter=2' follows 'fp16' without a colon"),
        (" ; ", r"names no method"),
    ],
)
def test_parse_methods_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_methods(text)


def test_default_methods_cover_every_registered_compressor():
    labels = [m.label for m in default_methods()]
    assert labels[:3] == ["ddp", "torch-fp16", "torch-powersgd:rank=4"]
    assert set(available()) <= set(labels)


def test_shape_files_hold_the_real_models():
    # published parameter counts: torchvision ResNet-50, BERT-base (with pooler), GPT-2 small
    expected = {"resnet50": 25_557_032, "bert": 109_482_240, "gpt2": 124_439_808}
    for name in SHAPE_SETS:
        shapes = load_shapes(name)
        assert sum(math.prod(s) for _, s in shapes) == expected[name]
        assert len({n for n, _ in shapes}) == len(shapes)
    assert dict(load_shapes("gpt2"))["h.0.attn.c_attn.weight"] == (768, 2304)


def test_scale_keeps_kernels_and_aspect():
    shapes = [("conv", (256, 128, 3, 3)), ("fc", (1000, 2048)), ("b", (1000,)), ("tiny", (2,))]
    scaled = dict(scale_shapes(shapes, 0.25))
    assert scaled["conv"] == (128, 64, 3, 3) and scaled["fc"] == (500, 1024)
    assert scaled["b"] == (250,) and scaled["tiny"] == (1,)  # never below one
    total = sum(math.prod(s) for _, s in load_shapes("bert", 0.1))
    assert 0.08 < total / 109_482_240 < 0.12  # rounding of each dimension moves it a little
    for bad in (0, -1, float("nan")):
        with pytest.raises(ConfigError, match="scale"):
            scale_shapes(shapes, bad)


def test_shaped_gradients_are_low_rank_products():
    task = ShapedTask("resnet50", 0.01, k=3)
    model = task.model()
    task.loss(model, step=4, rank=1, world_size=2).backward()
    g = torch.Generator().manual_seed(((0 * 1_000_003 + 4) * 4099 + 1) % (2**63))
    for (name, shape), p in zip(task.shapes(), (model.get_parameter(n) for n, _ in task.shapes())):
        assert p.grad is not None and p.grad.shape == shape, name
        if len(shape) >= 2:
            u = torch.randn(shape[0], 3, generator=g)
            v = torch.randn(math.prod(shape[1:]), 3, generator=g)
            torch.testing.assert_close(p.grad, (u @ v.T).view(shape))
        else:
            torch.testing.assert_close(p.grad, torch.randn(shape, generator=g))
    # another rank draws other gradients
    other = task.model()
    task.loss(other, step=4, rank=0, world_size=2).backward()
    assert not torch.equal(other.fc.weight.grad, model.fc.weight.grad)


def test_detect_launcher():
    assert detect_launcher({}).kind == "none"
    tr = detect_launcher({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "LOCAL_WORLD_SIZE": "2"})
    assert (tr.kind, tr.rank, tr.world_size, tr.local_world_size) == ("torchrun", 1, 4, 2)
    mpi = detect_launcher({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert (mpi.kind, mpi.rank, mpi.world_size) == ("mpirun", 3, 4)
    assert detect_launcher({"PMI_RANK": "0", "PMI_SIZE": "2"}).kind == "mpirun"


def _raw(step_times: list[list[list[float]]], bytes_sent: list[int], compute: list[list[float]]) -> dict:
    """Synthetic per-rank measurements: step_times[rank][method] lists of seconds."""
    labels = ["ddp", "fp16"]
    return {
        "workload": {"name": "gpt2", "scale": 0.1, "batch": 8, "numel": 1000, "grad_bytes": 4000},
        "world_size": 2,
        "steps": 4,
        "warmup": 2,
        "ranks": [
            {
                "rank": r,
                "compute_seconds": compute[r],
                "methods": [
                    {
                        "label": lab,
                        "kind": "ddp" if lab == "ddp" else "commpress",
                        "note": "",
                        "bucket_cap_mb": None,
                        "step_seconds": step_times[r][i],
                        "bytes_sent": bytes_sent[i],
                        "compute_seconds": 0.004 * i,
                    }
                    for i, lab in enumerate(labels)
                ],
            }
            for r in range(2)
        ],
    }


def test_summarize_takes_slowest_rank_per_step():
    raw = _raw(
        step_times=[[[1.0, 1.0, 1.0, 1.0], [0.4, 0.9, 0.4, 0.4]], [[0.5, 2.0, 1.0, 3.0], [0.5, 0.5, 0.5, 0.5]]],
        bytes_sent=[16000, 8000],
        compute=[[0.1, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2]],
    )
    s = summarize(raw)
    ddp, fp16 = s["methods"]
    assert s["compute_seconds_median"] == pytest.approx(0.2)
    assert ddp["step_seconds_median"] == pytest.approx(1.5)  # max per step: 1, 2, 1, 3
    assert fp16["step_seconds_median"] == pytest.approx(0.5)  # max per step: .5 .9 .5 .5
    assert ddp["bytes_per_step"] == 4000 and ddp["compression"] == pytest.approx(1.0)
    assert fp16["compression"] == pytest.approx(2.0)
    assert fp16["speedup"] == pytest.approx(3.0) and ddp["speedup"] == pytest.approx(1.0)
    assert fp16["compress_seconds"] == pytest.approx(0.001)
    assert fp16["network_seconds"] == pytest.approx(0.5 - 0.2 - 0.001)
    text = format_report(s)
    assert "fp16" in text and "3.00x" in text and "2.0x" in text


@pytest.mark.parametrize(
    ("link", "hosts", "noted"),
    [
        (None, ["h", "h"], True),  # --local or torchrun on one machine: loopback
        ("unlimited", ["h", "h"], True),  # linkemu without --rate
        ("100mbit", ["h", "h"], False),  # linkemu with a real limit
        (None, ["h1", "h2"], False),  # a real network between hosts
    ],
)
def test_loopback_runs_say_where_compression_pays(link, hosts, noted):
    raw = _raw([[[1.0] * 4, [0.5] * 4]] * 2, [16000, 8000], [[0.1] * 4] * 2)
    for rank, host in zip(raw["ranks"], hosts):
        rank["host"] = host
    if link is not None:
        raw["link"] = link
    summary = summarize(raw)
    text = format_report(summary)
    assert summary["loopback"] is noted
    assert (LOOPBACK_NOTE in text) is noted
    assert "compression pays only when the network is the bottleneck" in LOOPBACK_NOTE
    assert "commpress linkemu" in LOOPBACK_NOTE


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is in the bench and test extras")
    raw = _raw([[[1.0] * 4, [0.5] * 4]] * 2, [16000, 8000], [[0.1] * 4] * 2)
    out = tmp_path / "bench.png"
    write_plot(summarize(raw), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors_are_clear(capsys):
    assert main(["bench", "--methods", "nosuch"]) == 2
    assert "neither a baseline nor a commpress method" in capsys.readouterr().err
    assert main(["bench", "--methods", "fp16:start_iter=9", "--warmup", "3"]) == 2
    assert "--warmup = 3 is not accepted" in capsys.readouterr().err
    assert main(["bench", "--methods", "ddp", "--scale", "0"]) == 2
    assert main(["bench", "--methods", "ddp"]) == 2  # no launcher and no --local
    assert "--local N" in capsys.readouterr().err


@pytest.fixture(scope="module")
def two_ranks():
    methods = tuple(parse_methods("ddp;torch-fp16;torch-powersgd:rank=2;fp16;none"))
    plan = BenchPlan(methods, workload="gpt2", scale=0.01, steps=3, warmup=2, bucket_cap_mb=1.0, progress=False)
    return run_local(bench_rank, 2, plan)


@pytest.mark.multiproc
def test_bench_rank_rows(two_ranks):
    raw = two_ranks[0]
    assert two_ranks[1]["ranks"] == raw["ranks"]  # every rank returns everyone's results
    grad = raw["workload"]["grad_bytes"]
    s = summarize(raw)
    rows = {r["label"]: r for r in s["methods"]}
    steps = raw["steps"]
    assert rows["ddp"]["bytes_per_step"] == grad
    assert rows["none"]["bytes_per_step"] == grad
    assert rows["torch-fp16"]["bytes_per_step"] == grad / 2  # counted from PyTorch's all-reduce calls
    assert rows["fp16"]["bytes_per_step"] == grad / 2
    assert rows["torch-powersgd:rank=2"]["compression"] > 5
    assert rows["torch-powersgd:rank=2"]["bucket_cap_mb"] > grad / 2**20  # one bucket
    # the shaped model (4.8 MiB) in 1 MB buckets: the hook runs once per real DDP bucket
    fp16 = raw["ranks"][0]["methods"][3]
    assert fp16["collectives"] / steps >= 4
    for r in s["methods"]:
        assert r["step_seconds_median"] > 0 and r["step_seconds_q1"] <= r["step_seconds_median"] <= r["step_seconds_q3"]
    assert rows["fp16"]["compress_seconds"] > 0


@pytest.mark.multiproc
def test_interleaved_rows_count_what_the_sequential_rows_count(two_ranks):
    """--interleave: every row steps in turn on models built up front; bytes, collectives and
    step counts per row are those of the row-after-row run (PyTorch's fp16 hook included,
    counted per step); Local SGD rows: tests/test_local_sgd_bench.py."""
    methods = tuple(parse_methods("ddp;torch-fp16;torch-powersgd:rank=2;fp16;none"))
    plan = BenchPlan(methods, workload="gpt2", scale=0.01, steps=3, warmup=2, bucket_cap_mb=1.0, progress=False, interleave=True)
    raw = run_local(bench_rank, 2, plan)[0]
    assert raw["interleaved"] is True and "interleaved" in format_report(summarize(raw))
    sequential = two_ranks[0]["ranks"][0]["methods"]
    for row, reference in zip(raw["ranks"][0]["methods"], sequential, strict=True):
        assert row["label"] == reference["label"]
        assert (row["bytes_sent"], row["collectives"]) == (reference["bytes_sent"], reference["collectives"])
        assert len(row["step_seconds"]) == plan.steps
    assert len(raw["ranks"][0]["compute_seconds"]) == plan.steps


@pytest.mark.multiproc
def test_cli_local_run_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--local",
            "2",
            "--methods",
            "ddp,fp16",
            "--workload",
            "charlm",
            "--batch",
            "4",
            "--steps",
            "2",
            "--warmup",
            "2",
            "--json",
            str(path),
            "--quiet",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "speed-up over ddp" in out
    assert out.rstrip().endswith(LOOPBACK_NOTE)  # two ranks on this machine, no link limit
    data = json.loads(path.read_text())
    assert data["loopback"] is True
    assert [m["label"] for m in data["methods"]] == ["ddp", "fp16"]
    assert data["methods"][1]["compression"] == pytest.approx(2.0)


def test_collect_markdown_tables():
    from commpress.bench.collect import markdown_tables

    a = summarize({**_raw([[[1.0] * 4, [0.5] * 4]] * 2, [16000, 8000], [[0.1] * 4] * 2), "link": "100mbit"})
    b = summarize({**_raw([[[0.2] * 4, [0.2] * 4]] * 2, [16000, 8000], [[0.1] * 4] * 2), "link": "unlimited"})
    text = markdown_tables([b, a])
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| method | 2 ranks"))
    assert header == "| method | 2 ranks, 100mbit | 2 ranks, unlimited |"
    assert "| fp16 | 500 ms (2.00x) | 200 ms (1.00x) |" in lines
    assert "| fp16 | 2,000 | 2.0x |" in lines  # 8000 bytes over 4 steps


def test_fsdp_bench_rows_include_fsdp2_bf16():
    from commpress.cli.bench_fsdp import FSDP_ROWS, parse_rows

    bf16 = next(r for r in FSDP_ROWS if r.label == "fsdp-bf16")
    assert bf16.mixed_precision == "bf16" and bf16.config == FSDP_ROWS[0].config  # plain collectives, counted
    (bare,) = parse_rows("fsdp-bf16")
    assert (bare.config, bare.mixed_precision) == (bf16.config, "bf16")
    (q,) = parse_rows("q:weight_bits=8,mixed_precision=fp16")
    assert (q.config, q.mixed_precision) == ({"weight_bits": 8}, "fp16")


@pytest.mark.multiproc
def test_fsdp_bench_bf16_row_halves_the_bytes(capsys):
    code = main(["bench-fsdp", "--local", "2", "--steps", "6", "--hidden", "16", "--batch", "4", "--rows", "fsdp;fsdp-bf16"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    plain, bf16 = (line.split() for line in lines[2:4])
    assert plain[0] == "fsdp" and bf16[0] == "fsdp-bf16"
    gather, scatter = (float(v.replace(",", "")) for v in plain[1:3])
    assert gather > 0 and scatter > 0
    assert [float(v.replace(",", "")) for v in bf16[1:3]] == [gather / 2, scatter / 2]  # bf16 on the wire
    assert bf16[3] == "2.00x"
    assert abs(float(bf16[6].rstrip("%"))) < 1.0  # the same training, within 1% of its loss


def test_a_malformed_launcher_variable_is_named():
    import pytest

    from commpress.comm.from_env import detect_launcher

    with pytest.raises(RuntimeError, match=r"WORLD_SIZE='two' is not an integer"):
        detect_launcher({"RANK": "0", "WORLD_SIZE": "two", "MASTER_ADDR": "x"})
