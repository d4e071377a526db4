"""``commpress.register`` loads the compressors' CPU kernels before the first step
(:mod:`commpress.comm.warm`), so a fresh process does not compile or load them inside its
first steps, on the training clock, while its peers wait: on 2 gloo ranks, after
``register()`` the method's numba dispatchers hold signatures before any step (a
dispatcher's ``.signatures`` is empty in a process until its first call, whatever numba's
disk cache holds), the first steps add none, and the warm-up changed nothing: the run's
state after registration and its model after the steps are bit for bit a run's with the
warm-up skipped. Also: the kernels work where numba finds no writable cache directory."""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import commpress
from commpress.bench.launch import run_local

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "docs" / "configs"
#: config -> (the kernel modules its method runs, whether the registration is a DDP hook)
CASES = {
    "topk.toml": (("topk",), True),  # 1% of each tensor; tensors under 1,024 elements whole
    "terngrad.toml": (("ternary", "stats"), True),  # the last layer left to an exact group
    "slow-link.toml": (("ternary", "stats", "huffman"), False),  # DiLoCo, TernGrad entropy-coded
}
STEPS = 4  # slow-link's DiLoCo syncs every 2 steps, landing one step late: two syncs


def _signatures() -> dict[str, frozenset[str]]:
    """Every numba dispatcher of the CPU kernels and the signatures it holds in this process."""
    import commpress.kernels.cpu as cpu

    found = {}
    for info in pkgutil.iter_modules(cpu.__path__):
        module = importlib.import_module(f"{cpu.__name__}.{info.name}")
        for name, value in vars(module).items():
            if hasattr(value, "signatures") and getattr(value, "__module__", None) == module.__name__:
                found[f"{info.name}.{name}"] = frozenset(map(str, value.signatures))
    return found


def _loaded(modules: tuple[str, ...]) -> bool:
    """Whether each of ``modules`` has a dispatcher holding a signature."""
    held = _signatures()
    return all(any(sigs for name, sigs in held.items() if name.split(".")[0] == m) for m in modules)


def _model() -> torch.nn.Module:
    """Tensors above 65,536 elements (Top-k's sampled selection), under it, under 1,024
    (sent whole) and a last layer (TernGrad's exact group)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 1536), torch.nn.ReLU(), torch.nn.Linear(1536, 16))


def _plain(value: Any) -> Any:
    """``value`` with tensors as lists, for a comparison bit for bit of nested states."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _run(name: str, rank: int, warm: bool) -> dict[str, Any]:
    """Register ``name`` on a fresh DDP model and take STEPS steps; ``warm=False`` skips
    the warm-up (no layouts to reduce)."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model())
    local_sgd = not CASES[name][1]
    opt = (torch.optim.AdamW if local_sgd else torch.optim.SGD)(model.parameters(), lr=1e-2)
    rng = torch.get_rng_state()
    skip = mock.patch("commpress.comm.warm.layouts", side_effect=lambda *a: []) if not warm else contextlib.nullcontext()
    with skip:
        reg = commpress.register(model, CONFIGS / name, optimizer=opt)
    out: dict[str, Any] = {
        "rng_kept": torch.equal(rng, torch.get_rng_state()),
        "loaded": _loaded(CASES[name][0]),
        "sent": reg.traffic.bytes_sent,
        "state": _plain(reg.state_dict()),
    }
    before = _signatures()
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(8, 64, generator=data)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    after = _signatures()
    out["added"] = {k: sorted(v - before.get(k, frozenset())) for k, v in after.items() if v - before.get(k, frozenset())}
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reg.remove()
    return out


def _warm_then_skipped(rank: int, world: int, name: str) -> dict[str, dict[str, Any]]:
    """The warmed run first (its kernels not yet loaded in this process), then the skipped one."""
    return {"warm": _run(name, rank, True), "skipped": _run(name, rank, False)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_register_loads_the_kernels_and_changes_nothing(name):
    for rank, got in enumerate(run_local(_warm_then_skipped, 2, name)):
        warm, skipped = got["warm"], got["skipped"]
        assert warm["loaded"], f"rank {rank}: {CASES[name][0]} kernels not loaded at register()"
        assert warm["added"] == {}, f"rank {rank}: kernels first called inside the steps: {warm['added']}"
        assert warm["rng_kept"] and warm["sent"] == skipped["sent"]
        assert warm["state"] == skipped["state"]  # step counters, compressor state, anchor: as without it
        assert torch.equal(warm["params"], skipped["params"])


def test_kernels_work_without_a_writable_cache_directory():
    """Where numba finds no cache directory (a read-only install, no writable user cache
    and no NUMBA_CACHE_DIR; here: numba told to look in zip files only) it refuses to
    decorate a cached function; the kernels are then compiled without the disk cache,
    with one warning."""
    import numba

    if not hasattr(numba.config, "CACHE_LOCATOR_CLASSES"):
        pytest.skip(f"numba {numba.__version__} has no NUMBA_CACHE_LOCATOR_CLASSES to hide its cache directories with")
    code = (
        "import warnings, torch, commpress.kernels as k\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    seed = k.derive_seed(1, 2)\n"
        "from commpress.kernels.cpu import _jit\n"
        "print(seed, len(_jit.UNCACHED) > 0, sum('NUMBA_CACHE_DIR' in str(x.message) for x in w))\n"
    )
    env = {**os.environ, "NUMBA_CACHE_LOCATOR_CLASSES": "ZipCacheLocator"}
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    from commpress.kernels import derive_seed

    assert done.stdout.split() == [str(derive_seed(1, 2)), "True", "1"]
