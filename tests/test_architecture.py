"""The package's shape, read from its imports: layers only import downward, no circles.

Layers, lowest first (docs/architecture.md draws them): shared basics, kernels, algorithms,
the config, backends, the bandwidth layer, the framework adapters, the one call that
applies a config through them (registration), what the commands run, the commands.
Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "commpress"

LAYERS = [
    {"errors", "schema", "cmdline", "terminal", "torch_compat"},
    {"kernels"},
    {"compressors"},
    {"config"},
    {"comm"},
    {"bandwidth", "layerwise"},
    {"hooks", "fsdp", "local_sgd", "optim"},
    {"registration", "parts", "replica_state"},  # one call that applies a config's tables through the adapters; its checkpoint
    {"workloads", "linkemu", "bench"},
    {"cli", "__main__"},
    {"__init__"},  # the package's front door re-exports the adapters
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


KNOWN: set[str] = set()


def _imports(path: Path) -> set[str]:
    """Every commpress module ``path`` imports (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("commpress")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.startswith("commpress"):
                # `from package import submodule` depends on the submodule only
                subs = {f"{target}.{a.name}" for a in node.names}
                found |= subs & KNOWN if subs & KNOWN else {target}
    return found


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}
KNOWN |= set(MODULES)
GRAPH = {name: {t for t in _imports(path) if t in MODULES} for name, path in MODULES.items()}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for i, members in enumerate(LAYERS):
        if top in members:
            return i
    raise AssertionError(f"module {module} is in no layer: add its package to LAYERS")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_down(module):
    upward = sorted(t for t in GRAPH[module] if _layer(t) > _layer(module))
    assert not upward, f"{module} (layer {_layer(module)}) imports higher layers: {upward}"


def test_no_import_circles():
    """Package ``__init__`` files re-export their submodules; a submodule that imports its
    own package's ``__init__`` closes a circle, so it must import the submodule instead."""
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_library_never_imports_the_commands():
    importers = sorted(m for m, targets in GRAPH.items() if any(t.startswith("commpress.cli") for t in targets))
    assert all(m.startswith(("commpress.cli", "commpress.__main__")) for m in importers), importers


def test_kernel_implementations_import_no_front_end():
    """``kernels/cpu`` (numba) and ``kernels/cuda`` (CuPy) are the two implementations; the
    front ends in ``kernels/`` check arguments and dispatch between them. An implementation
    imports its own package and the shared constants, never a front end or the other one."""
    wrong = {}
    for impl in ("commpress.kernels.cpu", "commpress.kernels.cuda"):
        for module, targets in GRAPH.items():
            if module == impl or module.startswith(f"{impl}."):
                allowed = {t for t in targets if t == impl or t.startswith(f"{impl}.")} | {"commpress.kernels._constants"}
                if targets - allowed:
                    wrong[module] = sorted(targets - allowed)
    assert not wrong, wrong


def test_the_bandwidth_layer_reaches_the_ranks_through_the_backend():
    """``bandwidth/`` measures links and opens scoped backends through the backend contract
    (``comm/links.py``); neither it nor ``layerwise/`` imports torch.distributed itself."""
    found = []
    paths = sorted((ROOT / "bandwidth").rglob("*.py")) + sorted((ROOT / "layerwise").rglob("*.py"))
    assert len(paths) > 10
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_the_files_run_first_exist():
    """conftest's SLOWEST_FILES name test files that exist (a renamed one would be sorted back
    among the others without a word)."""
    from conftest import SLOWEST_FILES

    tests = Path(__file__).resolve().parent
    assert [name for name in SLOWEST_FILES if not (tests / name).is_file()] == []


REPO = ROOT.parent
#: the folders whose Python files are code (benchmarks/results/ aside: the scripts a results
#: folder keeps are a record of what was run, not code)
CODE_DIRS = ("commpress", "tests", "scripts", "benchmarks", "asv_bench")
MAX_LINES = 400


def _code_files() -> list[Path]:
    """The Python files under CODE_DIRS (none of them holds a virtual environment)."""
    files = [f for d in CODE_DIRS for f in (REPO / d).rglob("*.py")]
    return [f for f in files if not f.relative_to(REPO).as_posix().startswith("benchmarks/results/")]


def test_no_code_file_is_over_400_lines():
    """Every code file has at most MAX_LINES lines: a longer one is split along its seams."""
    files = _code_files()
    assert any(f.parent == ROOT for f in files), "found none of the package's files"
    lines = {f.relative_to(REPO).as_posix(): len(f.read_text().splitlines()) for f in files}
    long = sorted((name, n) for name, n in lines.items() if n > MAX_LINES)
    assert not long, f"files over {MAX_LINES} lines (split them): " + ", ".join(f"{name} ({n} lines)" for name, n in long)


#: Where the library turns what a user handed it (a dict, a file, a Config) into a Config:
#: the public entry points only (file -> function or Class.method). Everything inside takes
#: the Config. The commands' layer (cli/, bench/, workloads/) reads its own files.
FRONT_DOORS = {
    "registration.py": {"register"},
    "hooks/state.py": {"CommState.__init__"},
    "hooks/ddp.py": {"register_ddp_hook"},
    "local_sgd/config.py": {"from_config"},
    "fsdp/config.py": {"load_fsdp_config"},  # fsdp.apply's
}


def test_only_the_front_doors_load_a_config():
    found: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in {"cli", "bench", "workloads"}:
            continue
        tree = ast.parse(path.read_text())
        for scope in ast.walk(tree):
            if not isinstance(scope, (ast.FunctionDef, ast.ClassDef)):
                continue
            bodies = [scope] if isinstance(scope, ast.FunctionDef) else [n for n in scope.body if isinstance(n, ast.FunctionDef)]
            for fn in bodies:
                name = fn.name if fn is scope else f"{scope.name}.{fn.name}"
                for node in ast.walk(fn):
                    func = node.func if isinstance(node, ast.Call) else None
                    if isinstance(func, ast.Attribute) and func.attr == "load" and getattr(func.value, "id", None) == "Config":
                        found.setdefault(rel, set()).add(name)
    # a method is seen once as a function and once under its class: keep the class's name
    found = {rel: {n for n in names if "." in n or not any(m.endswith(f".{n}") for m in names)} for rel, names in found.items()}
    assert found == FRONT_DOORS
