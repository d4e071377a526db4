"""Every command turns bad input into one line on stderr and exit status 2, before it starts a
rank; every ``--help`` renders."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import commpress.bench.launch
from commpress.bench.arguments import LIST_HELP
from commpress.cli import COMMANDS, build_parser, main, summary

#: Variables that would make a command think a launcher started it.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMI_SIZE")


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if a command starts ranks or joins a process group."""

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(commpress.bench.launch, "run_local", refuse)
    monkeypatch.setattr("torch.distributed.init_process_group", refuse)
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


BAD = [
    (["demo", "--methods", "powersdg"], "--methods 'powersdg': method = 'powersdg' is not a known compressor"),
    (["demo", "--methods", "powersgd:rank=0"], "--methods 'powersgd:rank=0'"),
    (["demo", "--methods", " ; "], "argument --methods: ' ; ' names no method; expected methods separated by"),
    (["demo", "--methods", "rank=2"], "argument --methods: 'rank=2' is not accepted: setting 'rank=2' follows no method"),
    (["demo", "--methods", "topk,ratio=0.1"], "setting 'ratio=0.1' follows 'topk' without a colon; write 'topk:ratio=0.1'"),
    (["demo", "--methods", "none,fp16;none"], "argument --methods: 'none,fp16;none' is not accepted: 'none' is named twice"),
    (["demo", "--steps", "0"], "argument --steps: '0' is not accepted; expected an integer >= 1"),
    (["demo", "--ranks", "0"], "argument --ranks: '0' is not accepted; expected an integer >= 1"),
    (["demo", "--ranks", "two"], "argument --ranks: 'two' is not accepted"),
    (["demo", "--steps", "-5"], "argument --steps: '-5' is not accepted"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "--local", "0"], "argument --local: '0' is not accepted"),
    (["bench", "--local", "2", "--methods", "nosuch"], "--methods 'nosuch': 'nosuch' is neither a baseline nor"),
    (["bench", "--local", "2", "--methods", "powersgd:rank=0"], "--methods 'powersgd:rank=0': method 'powersgd': rank = 0"),
    (["bench", "--local", "2", "--methods", "torch-powersgd:rank=x"], "--methods 'torch-powersgd:rank=x': baseline"),
    (["bench", "--local", "2", "--scale", "nan"], "argument --scale: 'nan' is not accepted; expected a number in (0, 1]"),
    (["bench", "--local", "2", "--scale", "2"], "argument --scale: '2' is not accepted; expected a number in (0, 1]"),
    (["bench", "--local", "2", "--scale", "0"], "argument --scale: '0' is not accepted; expected a number in (0, 1]"),
    (["bench", "--local", "2", "--steps", "0"], "argument --steps: '0' is not accepted; expected an integer >= 1"),
    (["bench", "--local", "2", "--methods", "ddp;;ddp"], "argument --methods: 'ddp;;ddp' is not accepted: 'ddp' is named twice"),
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
    (
        ["bench-fsdp", "--local", "2", "--rows", "fsdp;fsdp"],
        "argument --rows: 'fsdp;fsdp' is not accepted: 'fsdp' is named twice",
    ),
    (
        ["bench-fsdp", "--local", "2", "--rows", "q:weight_bits=8;q:weight_bits=4"],
        "--rows = 'q:weight_bits=8;q:weight_bits=4' names the row 'q' twice",
    ),
    (["bench-fsdp", "--local", "2", "--rows", "q:weight_bits=8,grad_bit"], "--rows: 'grad_bit' is no default row"),
    (["bench-fsdp", "--local", "2", "--rows", "q:mixed_precision=[1]"], "--rows: mixed_precision = [1]"),
    (
        ["bench-fsdp", "--local", "2", "--rows", ":weight_bits=8"],
        "argument --rows: ':weight_bits=8' is not accepted: ':weight_bits=8' has no method name",
    ),
    (["bench-fsdp", "--local", "0"], "argument --local: '0' is not accepted"),
    (["bench-fsdp", "--local", "2", "--hidden", "0"], "argument --hidden: '0' is not accepted"),
    (["bench-fsdp"], "needs --local N"),
    (
        ["bandwidth", "--local", "2", "--budgets", "abc"],
        "argument --budgets: 'abc' is not accepted; expected a finite number >= 0",
    ),
    (
        ["bandwidth", "--local", "2", "--budgets", "0,inf"],
        "argument --budgets: 'inf' is not accepted; expected a finite number >= 0",
    ),
    (["bandwidth", "--local", "2", "--budgets", " , "], "argument --budgets: ' , ' names nothing"),
    (["bandwidth", "--local", "2", "--seeds", "0"], "argument --seeds: '0' is not accepted; expected an integer >= 1"),
    (["bandwidth", "--local", "2", "--steps", "0"], "argument --steps: '0' is not accepted; expected an integer >= 1"),
    (
        ["bandwidth", "--local", "2", "--probe-ms", "20000"],
        "argument --probe-ms: '20000' is not accepted; expected a number in (0, 10000]",
    ),
    (
        ["bandwidth", "--local", "2", "--adaptive", "topk;topk"],
        "argument --adaptive: 'topk;topk' is not accepted: 'topk' is named twice",
    ),
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
    (["quality", "--steps", "0"], "argument --steps: '0' is not accepted; expected an integer >= 1"),
    (
        ["quality", "--tasks", "charlm;mnist"],
        "argument --tasks: 'mnist' is not accepted; accepted: charlm, shapes, transformer, resnet",
    ),
    (
        ["quality", "--methods", "bf16,topk:ratio=0.01,bf16"],
        "argument --methods: 'bf16,topk:ratio=0.01,bf16' is not accepted: 'bf16' is named twice",
    ),
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
        "accepted: acpsgd, bf16, fp16, none, onebit, powersgd, quant, terngrad, topk"
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


@pytest.mark.parametrize("argv", [[], *([c] for c in COMMANDS)], ids=["commpress", *COMMANDS])
def test_help_is_plain_text(argv, capsys):
    text = _help([*argv, "--help"], capsys)
    assert "``" not in text
    assert not re.search(r":[a-z]+:`", text)  # reST roles such as :mod:`x`
    assert not re.search(r"::$", text, re.M)  # "Example::"


def test_help_and_bad_options_load_nothing_heavy():
    """The parser of every command is built, each --help printed and a bad option refused
    without importing torch, numpy, numba or matplotlib: --help answers at once."""
    code = "\n".join(
        [
            "import sys",
            "from commpress.cli import COMMANDS, main",
            "for argv in [[], *([c] for c in COMMANDS)]:",
            "    try:",
            "        main([*argv, '--help'])",
            "    except SystemExit:",
            "        pass",
            "assert main(['bench', '--scale', '2']) == 2",
            "print(sorted(m for m in ('torch', 'numpy', 'numba', 'matplotlib') if m in sys.modules))",
        ]
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


#: Every option that takes a method list, and what it is called in its command's namespace.
METHOD_OPTIONS = [
    ("demo", "--methods"),
    ("bench", "--methods"),
    ("quality", "--methods"),
    ("bandwidth", "--methods"),
    ("bandwidth", "--adaptive"),
    ("bench-fsdp", "--rows"),
]


@pytest.mark.parametrize(("command", "option"), METHOD_OPTIONS, ids=[" ".join(o) for o in METHOD_OPTIONS])
def test_every_method_option_reads_one_grammar(command, option, capsys):
    parser = build_parser()[0]
    for text in (
        "none,topk:ratio=0.01,min_numel=0,fp16",
        "none;topk:ratio=0.01,min_numel=0;fp16",
        "none , topk:ratio=0.01,min_numel=0;fp16",
    ):
        args = parser.parse_args([command, option, text])
        assert getattr(args, option[2:]) == ["none", "topk:ratio=0.01,min_numel=0", "fp16"], text
    assert LIST_HELP in " ".join(_help([command, "--help"], capsys).split())


def test_demo_low_rank_rows_start_after_a_tenth_of_the_steps():
    from commpress.cli.demo import DEMO_ROWS, demo_rows

    def starts(rows):
        return {r.label: r.config["start_iter"] for r in rows if "start_iter" in r.config}

    assert starts(DEMO_ROWS) == {"powersgd": 20, "acpsgd": 20}  # the demo table's run (docs/benchmarks.md): 200 steps
    assert starts(demo_rows(20)) == {"powersgd": 2, "acpsgd": 2}
    assert starts(demo_rows(5)) == {"powersgd": 0, "acpsgd": 0}


def test_demo_marks_a_method_that_never_compressed():
    from commpress.cli.demo import never_compressed, render, rows_from_specs

    rows = rows_from_specs(["none", "powersgd", "powersgd:rank=4,start_iter=50"], 20)
    assert rows[1].config["start_iter"] == 2  # a demo row's name is that row, for this run's length
    late = never_compressed(rows, 20)
    assert late == {"powersgd:rank=4,start_iter=50": 50}
    results = [
        {"label": r.label, "bytes_per_step": b, "step_seconds": 0.01, "eval_loss": 3.0} for r, b in zip(rows, (1000, 200, 1000))
    ]
    lines = render(results, late, 20).splitlines()
    assert lines[-3].split()[2] == "5.0x" and lines[-2].split()[2] == "1.0x*"
    assert lines[-1] == (
        "* powersgd:rank=4,start_iter=50: start_iter = 50 is not below --steps 20: it never compressed "
        "(plain all-reduce throughout); give more steps or a smaller start_iter"
    )
    assert "*" not in render(results[:2], never_compressed(rows[:2], 20), 20)
