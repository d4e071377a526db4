"""No method is named outside ``commpress/compressors/``: the rest asks the class
(:class:`~commpress.compressors.base.Compressor`), so adding a method touches its own file.

Read from the code, not the docs: every string in a module (docstrings aside) is searched
for the name of every registered method. Two kinds of names are not searched:

- :data:`~commpress.compressors.EXACT` (``none``), the exact average the contract itself
  names, which every layer falls back to (and a word with other meanings: no launcher, an
  unlimited link);
- the methods the tests register (``test-...``).

The files allowed to name methods are configuration: what the benchmark and demo commands
run by name, and examples in the command line's help and messages.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from commpress.compressors import EXACT, available

ROOT = Path(__file__).resolve().parents[1] / "commpress"

#: file -> why it may name methods
CONFIGURATION = {
    "bench/catalog.py": "the quality rows, by name",
    "bench/gpucheck/ddp.py": "the methods the GPU check trains, each with its parameters",
    "bench/gpucheck/lowrank.py": "the low-rank rows the GPU check times",
    "bench/gpucheck/sharded.py": "the method the GPU check's sharded rows compress with",
    "bench/quality.py": "what each quality row runs",
    "bench/throughput.py": "the rows `commpress bench` times by default",
    "cli/bandwidth.py": "the settings `commpress bandwidth` compares by default",
    "cli/demo.py": "the demo's rows, and an example in its help",
    "cli/quality.py": "an example in its help",
    "cli/race.py": "the race's default rows",
    "cli/ranks.py": "an example in its help",
    "cli/bench_fsdp.py": "fp16 and bf16 here are FSDP's mixed-precision dtypes, not methods",
    "bench/arguments.py": "an example of the method grammar in its messages",
    "kernels/cuda/_launch.py": "topk is the top-k selection op's CUDA source (kernels/cuda/topk.cu), below the methods",
}


def _methods() -> list[str]:
    return [m for m in available() if m != EXACT and not m.startswith("test-")]


def _strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant in ``path`` but docstrings (f-strings' parts too)."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def _named(path: Path) -> list[str]:
    """Where ``path`` names a method: ``line: text``."""
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, _methods())) + r")(?![\w-])")
    return [f"{line}: {text!r}" for line, text in _strings(path) if pattern.search(text)]


MODULES = sorted(p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] != "compressors")
SEARCHED = [p for p in MODULES if p.relative_to(ROOT).as_posix() not in CONFIGURATION]


@pytest.mark.parametrize("path", SEARCHED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_method_is_named_outside_the_compressors(path):
    named = _named(path)
    assert not named, f"{path.relative_to(ROOT)}: ask the Compressor instead of naming a method:\n" + "\n".join(named)


def test_the_search_finds_a_name_in_code_and_messages_not_in_docstrings(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""Top-k (``topk``) is documented here."""\n'
        'def f(c):\n    """``topk`` again."""\n    return c.name == "topk"\n'
        'def g(c):\n    raise ValueError(f"use method {c!r} or \'powersgd\'")\n'
        'H = "topk-dgc-layerwise" + "torch-powersgd"\n'
    )
    assert [line.split(":")[0] for line in _named(module)] == ["4", "6"]


def test_every_method_is_searched_and_the_configuration_files_still_name_them():
    """Every package method is searched for, and every file allowed to name methods still
    does (else it leaves the list)."""
    assert {"topk", "powersgd", "acpsgd", "terngrad", "quant", "onebit", "fp16", "bf16"} <= set(_methods())
    for rel in CONFIGURATION:
        assert _named(ROOT / rel), f"{rel} names no method: take it off CONFIGURATION"
