"""Every command turns bad input into one line on stderr and exit status 2, before it starts a
rank; every ``--help`` renders."""

from __future__ import annotations

import subprocess
import sys

import pytest

import commpress.comm.launch
from commpress.cli import COMMANDS, main, summary

#: Variables that would make a command think a launcher started it.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMI_SIZE")


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if a command starts ranks or joins a process group."""

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(commpress.comm.launch, "run_local", refuse)
    monkeypatch.setattr("torch.distributed.init_process_group", refuse)
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


BAD = [
    (["demo", "--methods", "powersdg"], "--methods 'powersdg': method = 'powersdg' is not a known compressor"),
    (["demo", "--methods", "powersgd:rank=0"], "--methods 'powersgd:rank=0'"),
    (["demo", "--methods", " ; "], "--methods = ' ; ' names no method"),
    (["demo", "--ranks", "0"], "argument --ranks: '0' is not accepted; expected an integer >= 1"),
    (["demo", "--ranks", "two"], "argument --ranks: 'two' is not accepted"),
    (["demo", "--steps", "-5"], "argument --steps: '-5' is not accepted"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "--local", "0"], "argument --local: '0' is not accepted"),
    (["bench", "--local", "2", "--methods", "nosuch"], "--methods 'nosuch': 'nosuch' is neither a baseline nor"),
    (["bench", "--local", "2", "--methods", "powersgd:rank=0"], "--methods 'powersgd:rank=0': powersgd: rank = 0"),
    (["bench", "--local", "2", "--methods", "torch-powersgd:rank=x"], "--methods 'torch-powersgd:rank=x': baseline"),
    (["bench", "--local", "2", "--scale", "nan"], "argument --scale: 'nan' is not accepted; expected a finite number > 0"),
    (["bench", "--local", "2", "--warmup", "1"], "argument --warmup: '1' is not accepted; expected an integer >= 2"),
    (["bench", "--local", "2", "--bucket-cap-mb", "0"], "argument --bucket-cap-mb: '0' is not accepted"),
    (["bench", "--local", "2", "--methods", "ddp", "--json", "/nonexistent/b.json"], "--json = '/nonexistent/b.json'"),
    (["bench", "--local", "2", "--config", "/nonexistent/c.toml"], "--config: config file '/nonexistent/c.toml' does not exist"),
    (["bench", "--methods", "ddp"], "pass --local N"),
    (["bench-fsdp", "--local", "2", "--steps", "3"], "argument --steps: '3' is not accepted; expected an integer >= 6"),
    (["bench-fsdp", "--local", "4", "--mesh", "2x2"], "--mesh = '2x2' is not accepted"),
    (["bench-fsdp", "--local", "4", "--mesh", "2,3"], "--mesh = '2,3' is not accepted"),
    (["bench-fsdp", "--local", "2", "--rows", "q:weight_bits=3"], "--rows 'q:weight_bits=3': fsdp.weight_bits = 3"),
    (["bench-fsdp", "--local", "2", "--rows", "q:mixed_precision=fp8"], "--rows: mixed_precision = 'fp8'"),
    (["bench-fsdp", "--local", "2", "--rows", "fsdp;fsdp"], "--rows = 'fsdp;fsdp' names a row twice"),
    (["bench-fsdp", "--local", "2", "--rows", "q:mixed_precision=[1]"], "--rows: mixed_precision = [1]"),
    (["bench-fsdp", "--local", "2", "--rows", ":weight_bits=8"], "--rows: ':weight_bits=8' has no label"),
    (["bench-fsdp", "--local", "0"], "argument --local: '0' is not accepted"),
    (["bench-fsdp", "--local", "2", "--hidden", "0"], "argument --hidden: '0' is not accepted"),
    (["bench-fsdp"], "needs --local N"),
    (["bandwidth", "--local", "2", "--budgets", "abc"], "--budgets = 'abc' is not accepted"),
    (["bandwidth", "--local", "2", "--budgets", "inf"], "--budgets = 'inf' is not accepted"),
    (["bandwidth", "--local", "2", "--methods", "powersdg"], "--methods 'powersdg': method = 'powersdg'"),
    (["bandwidth", "--local", "2", "--adaptive", "topk:ratio=2"], "--adaptive 'topk:ratio=2': method 'topk': ratio = 2.0"),
    (["bandwidth", "--local", "2", "--expect-domains", "0,1/1"], "--expect-domains = '0,1/1' is not accepted"),
    (["bandwidth", "--local", "4", "--expect-domains", "0,1"], "--expect-domains = '0,1' is not accepted"),
    (["bandwidth", "--local", "2", "--methods", "", "--adaptive", ""], "--methods and --adaptive name no row"),
    (["bandwidth", "--local", "0"], "argument --local: '0' is not accepted"),
    (["bandwidth", "--local", "2", "--probe-ms", "inf"], "argument --probe-ms: 'inf' is not accepted"),
    (["bandwidth"], "pass --local N"),
    (["linkemu", "--ranks", "0"], "argument --ranks: '0' is not accepted"),
    (["linkemu", "--port", "70000"], "argument --port: '70000' is not accepted; expected an integer from 1 to 65535"),
    (["linkemu", "--timeout", "-1"], "argument --timeout: '-1' is not accepted"),
    (["linkemu", "--ranks", "3", "--nodes", "2"], "nodes = 2 is not accepted"),
    (["linkemu", "--rate", "fast"], "rate = 'fast' is not accepted"),
    ([], "the following arguments are required: command"),
    (["nosuch"], "argument command: invalid choice: 'nosuch'"),
]


@pytest.mark.parametrize(("argv", "needle"), BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(argv, needle, no_ranks, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n")
    assert needle in err
    prefix = "commpress " + argv[0] if argv and argv[0] in COMMANDS else "commpress"
    assert err.startswith(prefix + ": ")


def test_the_real_entry_point_fails_fast_without_a_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "commpress", "demo", "--methods", "powersdg"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "commpress demo: --methods 'powersdg': method = 'powersdg' is not a known compressor; "
        "accepted: acpsgd, bf16, fp16, none, powersgd, terngrad, topk"
    ]


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_help_renders(command, capsys):
    text = _help([command, "--help"], capsys)
    assert text.startswith(f"usage: commpress {command} ")
    assert "-h, --help" in text


def test_top_help_lists_each_command_with_its_whole_first_sentence(capsys):
    text = " ".join(_help(["--help"], capsys).split())
    for name, path in COMMANDS.items():
        doc = sys.modules[path].__doc__
        assert summary(doc).endswith(".")
        assert f"{name} {summary(doc)}" in text
    assert "single global settings on the demo task." in text  # bandwidth's, once cut off


def test_help_keeps_example_lines_as_written(capsys):
    lines = _help(["bandwidth", "--help"], capsys).splitlines()
    assert "    sudo python -m commpress linkemu --ranks 4 --nodes 2 --inter-rate 100mbit -- \\" in lines
    assert "        python -m commpress bandwidth --steps 200 --expect-domains 0,1/2,3" in lines
    bench = _help(["bench", "--help"], capsys)
    assert "'ddp;torch-powersgd:rank=4;powersgd:rank=4'" in bench  # not broken at the hyphen


def test_kernel_bench_usage_names_its_module(capsys):
    from commpress.bench import kernels

    with pytest.raises(SystemExit):
        kernels.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m commpress.bench.kernels ")


def test_summary_is_the_first_sentence():
    assert summary("Do a thing, and\nanother. More words.\n\nDetails.") == "Do a thing, and another."
    assert summary("No full stop\nhere") == "No full stop here"


def test_progress_labels_fit_the_longest_row():
    from commpress.cli.demo import DEMO_ROWS, progress_labels

    labels = progress_labels([row.label for row in DEMO_ROWS])
    assert len({len(label) for label in labels}) == 1  # the bars start in one column
    for row, label in zip(DEMO_ROWS, labels):
        assert label.rstrip().endswith(row.label)
    assert progress_labels(["a", "bbb"]) == ["[1/2] a  ", "[2/2] bbb"]
