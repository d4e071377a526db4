"""``commpress.register``: one call applies every table of one config that applies to the
model, and refuses, saying why, each one that cannot. Every ready config of docs/configs/
is loaded and trained with on 2 gloo ranks, the training loop staying
``loss.backward(); optimizer.step()``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import commpress
from commpress import Config, ConfigError
from commpress.bench.launch import run_local
from commpress.compressors import available
from commpress.config.tables import TABLES
from commpress.optim import HybridOptimizer

CONFIGS = Path(__file__).resolve().parents[1] / "docs" / "configs"
FILES = sorted(p.name for p in CONFIGS.iterdir())
#: how each file's model is built: DDP unless it configures a sharded model
SHARDED = {"fsdp_qsdp.toml"}
#: the parts each run applies, where not the DDP hook
PARTS = {
    "fsdp_qsdp.toml": ["fsdp"],
    "local_sgd_h4.toml": ["local_sgd"],
    "co2_h4.toml": ["local_sgd"],
    "diloco.toml": ["local_sgd"],
    "streaming-diloco.toml": ["local_sgd"],
    "slow-link.toml": ["local_sgd"],
    "slow-link-h1.toml": ["local_sgd"],
    "slow-link-muon.toml": ["local_sgd"],
    "float64 local_sgd": ["local_sgd"],
    "onebit_adam.toml": ["onebit_adam"],
    "dion.toml": ["dion"],
}
#: files whose table takes over AdamW's step (the others train with SGD)
ADAMW = {"onebit_adam.toml"}
#: files whose table takes over Muon's step: Muon on the first layer's matrix, AdamW on the rest
MUON = {"dion.toml"}
#: the configs also run through the explicit trainer API
EXPLICIT = ("local_sgd_h4.toml", "co2_h4.toml", "diloco.toml", "streaming-diloco.toml")


def test_every_method_and_feature_has_a_ready_file():
    configs = [Config.load(CONFIGS / f) for f in FILES]
    assert {m for m in available() if not m.startswith("test-")} <= {c.method for c in configs}
    assert {t for c in configs for t in c.sections} == set(TABLES)  # a ready file for every table
    assert {c.section("local_sgd").algorithm for c in configs if c.section("local_sgd")} == {"local_sgd", "co2", "diloco"}
    assert any(c.params.get("dgc") for c in configs)
    assert {Path(f).suffix for f in FILES} == {".toml", ".json"}


def test_json_and_toml_hold_the_same_schema():
    assert Config.load(CONFIGS / "powersgd.json") == Config.load(CONFIGS / "powersgd.toml")


def test_a_single_process_has_nothing_to_apply():
    """Without torch.distributed (a script run without its launcher) there is nobody to
    send to: register checks the config and applies nothing."""
    model = torch.nn.Linear(4, 2)
    reg = commpress.register(model, CONFIGS / "bf16.toml", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert reg.parts == () and reg.traffic.bytes_sent == 0 and reg.state_dict() == {}
    assert commpress.register(model, CONFIGS / "fsdp_qsdp.toml").parts == ()  # Accelerate's FSDP also shards only when launched
    with pytest.raises(ConfigError, match=r"unknown config key 'rank': it belongs in \[params\] of method acpsgd or powersgd"):
        commpress.register(model, {"method": "powersgd", "rank": 4})


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 8)).to(dtype)


def _wrap(name: str, model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if name not in SHARDED:
        return DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1) for p in model.parameters()])


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, step, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Two Local SGD / CO2 rounds of the user's loop, ``step()`` ending each; the last loss."""
    data = torch.Generator().manual_seed(rank)
    for _ in range(8):
        x = torch.randn(16, 64, generator=data, dtype=dtype)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        step()
    return loss


def _explicit(path: Path, rank: int) -> torch.Tensor:
    """The same run through the explicit trainer API (``trainer.step()``): its final model."""
    from torch.nn.parallel import DistributedDataParallel

    from commpress.local_sgd import from_config

    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = from_config(model, opt, path)
    _steps(model, opt, trainer.step, rank, torch.float32)
    trainer.finish()
    return _flat(model)


def _train(path: Path, rank: int, dtype: torch.dtype = torch.float32) -> dict:
    """A few steps with the config at ``path``: the user's loop, unchanged."""
    model = _wrap(path.name, _model(dtype))
    if path.name in ADAMW:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif path.name in MUON:
        matrix, *rest = model.parameters()
        opt = HybridOptimizer([torch.optim.Muon([matrix], lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)])
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    reg = commpress.register(model, path, optimizer=opt, total_steps=8 if path.name in ADAMW else None)
    loss = _steps(model, opt, opt.step, rank, dtype)
    reg.finish()
    whole = reg.state_dict(full=True)  # a collective: every rank's parts, as a rank-0 checkpoint holds them
    reg.load_state_dict(whole)  # each part takes its own back
    adaptive = reg.hook.adaptive if reg.hook is not None else None
    return {
        "parts": sorted(p.name for p in reg.parts),
        "domain_sent": adaptive.domain_traffic.bytes_sent if adaptive is not None else None,
        "loss": loss.item(),
        "sent": reg.traffic.bytes_sent,
        "params": _flat(model),
        "whole": sorted(whole[next(iter(whole))]) if whole else [],
    }


def _refusals(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    def error(fn) -> str:
        try:
            fn()
        except (ConfigError, TypeError, RuntimeError) as exc:
            return str(exc)
        return "no error"

    def ddp(dtype: torch.dtype = torch.float32) -> DistributedDataParallel:
        return DistributedDataParallel(_model(dtype))

    def opt(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1)

    sharded = _wrap("fsdp_qsdp.toml", _model())
    return {
        "fsdp_on_ddp": error(lambda: commpress.register(ddp(), {"fsdp": {}})),
        "local_sgd_without_optimizer": error(lambda: commpress.register(ddp(), {"local_sgd": {"period": 2}})),
        "local_sgd_with_bandwidth": error(lambda: commpress.register(ddp(), {"local_sgd": {}, "bandwidth": {"adaptive": True}})),
        "method_on_sharded": error(lambda: commpress.register(sharded, {"method": "powersgd", "fsdp": {}})),
        "sharded_without_fsdp": error(lambda: commpress.register(sharded, {})),
        "plain_module": error(lambda: commpress.register(_model(), {"method": "bf16"})),
        "float64_powersgd": error(lambda: commpress.register(ddp(torch.float64), {"method": "powersgd"})),
        "float64_powersgd_advice": error(
            lambda: commpress.register(
                ddp(torch.float64), {"method": "powersgd", "overrides": [{"params": ["*"], "method": "none"}]}
            )
        ),
        "float64_local_sgd_powersgd": error(
            lambda: commpress.register(m := ddp(torch.float64), {"method": "powersgd", "local_sgd": {}}, optimizer=opt(m))
        ),
        "step_refused": error(lambda: commpress.register(m := ddp(), {"local_sgd": {}}, optimizer=opt(m)).local_sgd.step()),
    }


def _all(rank: int, world: int) -> dict:
    out = {name: _train(CONFIGS / name, rank) for name in FILES}
    out["float64 none"] = _train(CONFIGS / "none.toml", rank, torch.float64)
    out["float64 local_sgd"] = _train(CONFIGS / "local_sgd_h4.toml", rank, torch.float64)
    out["explicit"] = {name: _explicit(CONFIGS / name, rank) for name in EXPLICIT}
    out["refusals"] = _refusals(rank)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_local(_all, 2)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [*FILES, "float64 none", "float64 local_sgd"])
def test_every_ready_config_trains_on_two_ranks(runs, name):
    a, b = (r[name] for r in runs)
    assert a["parts"] == PARTS.get(name, ["ddp_hook"])
    assert math.isfinite(a["loss"]) and math.isfinite(b["loss"])
    if name in ("bandwidth.toml", "bandwidth_layerwise.toml"):  # two ranks of one host: one domain, nothing crosses
        a, b = ({**r, "sent": r["domain_sent"]} for r in (a, b))
    assert a["sent"] > 0 and a["sent"] == b["sent"]
    assert torch.equal(a["params"], b["params"])  # averaged gradients, or models after the last round
    assert a["whole"] == ["ranks", "world_size"]  # state_dict(full=True) is the whole job's


@pytest.mark.multiproc
@pytest.mark.parametrize("name", EXPLICIT)
def test_optimizer_step_hooks_train_exactly_as_the_explicit_trainer(runs, name):
    for run in runs:
        assert torch.equal(run[name]["params"], run["explicit"][name])


@pytest.mark.multiproc
def test_a_table_that_cannot_apply_says_why(runs):
    errors = runs[0]["refusals"]
    assert "on a DistributedDataParallel model: the config's [fsdp] cannot apply" in errors["fsdp_on_ddp"]
    assert (
        "[local_sgd] table runs at the optimizer's step: pass register(..., optimizer=optimizer)"
        in (errors["local_sgd_without_optimizer"])
    )
    assert "the config's [bandwidth] cannot apply: [local_sgd] does not take it" in errors["local_sgd_with_bandwidth"]
    assert "(FSDP2): the config's method cannot apply: [fsdp] does not take it" in errors["method_on_sharded"]
    assert "this model takes only [fsdp]: add [fsdp]" in errors["sharded_without_fsdp"]
    assert "on a plain module (neither DistributedDataParallel nor sharded)" in errors["plain_module"]
    assert errors["float64_powersgd"].startswith("6 parameters of dtype float64 ('0.weight', '0.bias', '1.weight', ...)")
    assert errors["float64_powersgd_advice"] == "no error"  # the override the message suggests works
    assert "averages the model's float64 values with method 'powersgd'" in errors["float64_local_sgd_powersgd"]
    assert "call optimizer.step(), not step()" in errors["step_refused"]
