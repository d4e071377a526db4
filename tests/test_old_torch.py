"""commpress on torch 2.9, the oldest release it supports, tested on the torch installed here.

``tests/torch_2_9/sitecustomize.py`` on ``PYTHONPATH`` hides, in every process, the names this
torch has and 2.9 lacks (from all code but torch's own). With it, the demo (``python -m
commpress demo``), DDP hooks, FSDP2 and FSDP1 train on 2 gloo ranks and must give the same
bytes, losses and parameters, bit for bit, as without it: an unguarded call of a hidden name
fails there with AttributeError. Paths the run does not reach are covered by reading the
source: only ``commpress/torch_compat.py`` may name a hidden name.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commpress import torch_compat
from commpress.bench.launch import run_local

ROOT = Path(__file__).resolve().parents[1]
OLD = ROOT / "tests" / "torch_2_9"
STEPS = 6
DEMO_ROWS = ["fp16", "topk", "local-sgd+qsr"]  # demo rows; topk gathers, local SGD averages models
DDP = {
    "terngrad": {"method": "terngrad"},  # an all-gather and a max all-reduce per bucket
    "groups": {"method": "fp16", "overrides": [{"params": ["*.bias"], "method": "none"}]},
}
Q8 = {"weight_bits": 8, "grad_bits": 8}  # quantized ranges, embedding and biases raw
OFF = {"weight_bits": 32, "grad_bits": 32}  # FSDP2's plain collectives, through commpress


def _names() -> ModuleType:
    """The sitecustomize's name lists, loaded under another name (so it hides nothing here)."""
    spec = importlib.util.spec_from_file_location("torch_2_9_names", OLD / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NAMES = _names()
HIDDEN_NAMES = {n for names in (*NAMES.MODULE_NAMES.values(), *NAMES.CLASS_NAMES.values()) for n in names}


def test_only_torch_compat_names_a_hidden_name():
    found = []
    for path in sorted((ROOT / "commpress").rglob("*.py")):
        if path.name == "torch_compat.py" and path.parent.name == "commpress":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in HIDDEN_NAMES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} import {a.name}" for a in node.names if a.name in HIDDEN_NAMES]
            elif isinstance(node, ast.Constant) and node.value in HIDDEN_NAMES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not found, "names newer than torch 2.9 outside commpress/torch_compat.py (call them through it): " + ", ".join(found)


def test_the_newer_collective_is_preferred_and_the_older_one_used_without_it(monkeypatch):
    calls = []
    for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: calls.append((_name, k)), raising=False)
    out, inp = torch.empty(4), torch.ones(2)
    torch_compat.all_gather_single(out, inp, group=None, async_op=True)
    torch_compat.reduce_scatter_single(inp, out, op=dist.ReduceOp.AVG)
    monkeypatch.delattr(dist, "all_gather_single")
    monkeypatch.delattr(dist, "reduce_scatter_single")
    torch_compat.all_gather_single(out, inp)
    torch_compat.reduce_scatter_single(inp, out, op=dist.ReduceOp.MAX)
    names = [c[0] for c in calls]
    assert names == ["all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor"]
    assert calls[0][1] == {"group": None, "async_op": True}
    assert calls[1][1]["op"] == dist.ReduceOp.AVG and calls[3][1]["op"] == dist.ReduceOp.MAX


def test_fsdp_param_groups_of_both_layouts():
    a, b = object(), object()
    assert torch_compat.fsdp_param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]  # after 2.9
    assert torch_compat.fsdp_param_groups(SimpleNamespace(_fsdp_param_group=a)) == [a]  # 2.9
    assert torch_compat.fsdp_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


def test_a_torch_without_fsdp2_custom_collectives_is_refused_by_name(monkeypatch):
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    monkeypatch.delattr(_fsdp_api, "AllGather")
    spec = importlib.util.find_spec("commpress.torch_compat")
    fresh = importlib.util.module_from_spec(spec)  # a copy: the imported module stays as it is
    with pytest.raises(ImportError) as info:
        spec.loader.exec_module(fresh)
    assert str(info.value) == (
        f"commpress needs torch >= 2.9 for FSDP2's custom all-gather and reduce-scatter (commpress.fsdp) "
        f"(this is torch {torch.__version__})"
    )


def _reachable() -> list[str]:
    """The listed names that code here (not torch's) can read."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    found = [f"{m}.{n}" for m, names in NAMES.MODULE_NAMES.items() for n in names if hasattr(importlib.import_module(m), n)]
    for (m, c), names in NAMES.CLASS_NAMES.items():
        cls = getattr(importlib.import_module(m), c)
        probe = FSDPState() if cls is FSDPState else cls  # FSDPState's name is an instance attribute
        found += [f"{m}.{c}.{n}" for n in names if hasattr(probe, n)]
    return found


def _rank(rank: int, world: int, demo: bool) -> dict[str, Any]:
    from commpress.cli.demo import rows_from_specs
    from commpress.workloads.charlm import CharTask
    from commpress.workloads.train import train_ddp
    from commpress.workloads.train_fsdp import train_fsdp

    out: dict[str, Any] = {"reachable": _reachable(), "hidden": getattr(sys.modules.get("sitecustomize"), "HIDDEN", None)}
    if demo:  # what `commpress demo` trains: each row's bytes and final loss
        for row in rows_from_specs(DEMO_ROWS, STEPS):
            result = train_ddp(row.config, steps=STEPS)
            out[f"demo {row.label}"] = (result.bytes_per_step, result.eval_loss)
    for name, config in DDP.items():
        result = train_ddp(config, steps=STEPS, return_params=True, bucket_cap_mb=0.5)
        out[f"ddp {name}"] = (result.bytes_per_step, result.eval_loss, result.params)
    kw = {"steps": STEPS, "hidden": 64, "task": CharTask(batch_size=16), "return_params": True}
    for name, result in (
        ("fsdp2 q8", train_fsdp(Q8, **kw)),
        ("fsdp2 off", train_fsdp(OFF, **kw)),
        ("fsdp1 no_shard q8", train_fsdp(Q8, version=1, strategy="NO_SHARD", **kw)),
    ):
        sent = {side: (t["bytes_sent"], t["collectives"]) for side, t in result.traffic.items()}  # not the seconds
        out[name] = (sent, result.eval_loss, result.params)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.multiproc
def test_demo_ddp_and_fsdp_run_alike_with_the_newer_names_hidden(tmp_path, monkeypatch):
    reference = run_local(_rank, 2, True)
    assert reference[0]["hidden"] is None, "a sitecustomize hides names in the reference run"
    path = os.pathsep.join([str(OLD), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    monkeypatch.setenv("PYTHONPATH", path)  # inherited by the demo and by every rank process
    demo = ["demo", "--steps", str(STEPS), "--methods", ";".join(DEMO_ROWS), "--json", str(tmp_path / "demo.json")]
    proc = subprocess.run(
        [sys.executable, "-m", "commpress", *demo],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    hidden = run_local(_rank, 2, False)

    for ref, old in zip(reference, hidden):
        assert old["hidden"] is not None, "tests/torch_2_9/sitecustomize.py did not run in the rank processes"
        assert old["reachable"] == [], "names newer than torch 2.9 still reachable"
        assert set(ref["reachable"]) <= set(old["hidden"])
        for key in (k for k in old if k.startswith(("ddp ", "fsdp"))):
            assert _same(ref[key], old[key]), f"{key}: differs with the names hidden"
    rows = json.loads((tmp_path / "demo.json").read_text())
    expected = {label: reference[0][f"demo {label}"] for label in DEMO_ROWS}
    assert {row["label"]: (row["bytes_per_step"], row["eval_loss"]) for row in rows} == expected
