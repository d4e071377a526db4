"""Every config item (each table, and the top-level settings only some parts take), every
pair and every triple, on every kind of model: ``commpress.register`` either applies the
config whole (each item's part present in the Registration, and a training step taken) or
refuses it with a ConfigError naming the items and the model, as
:mod:`commpress.config.matrix` declares. The lower-level entry points (CommState,
register_ddp_hook, local_sgd.from_config, fsdp.apply) agree with the matrix, and the docs'
tables are the matrix's.

The distributed kinds run in a gloo group of one in this process (every part has its
collectives; none needs a peer), after the single-process kind; then every kind but the
replica groups' (``mesh=`` and ``manager=`` do not go together) under a torchft Manager of
one replica over that group (:class:`OneReplicaManager`)."""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import commpress
import commpress.fsdp
import commpress.registration
from commpress import Config, ConfigError
from commpress.config import matrix
from commpress.config.matrix import ITEMS, KINDS, label, refused_items
from commpress.optim import HybridOptimizer

ROOT = Path(__file__).resolve().parents[1]
#: Each item as a config sets it. ``backend = 'mpi'`` is not among them: applying it needs
#: an MPI launch (tests/test_mpi.py); test_the_mpi_backend_is_refused_where_the_matrix_says checks its refusals.
FRAGMENTS = {
    "method": {"method": "topk", "params": {"ratio": 0.5}},
    "overrides": {"overrides": [{"params": ["*.bias"], "method": "none"}]},
    "start_iter": {"start_iter": 1},
    "local_sgd": {"local_sgd": {"period": 1}},
    "fsdp": {"fsdp": {"min_numel": 0, "exclude": []}},
    "bandwidth": {"bandwidth": {"adaptive": True}},
    "layerwise": {"layerwise": {"enabled": True, "every": 1}},
    "onebit_adam": {"onebit_adam": {"warmup": 1}},
    "dion": {"dion": {"rank": 2}},
}
COMBOS = [c for n in range(4) for c in itertools.combinations(FRAGMENTS, n)]
DISTRIBUTED = ("DDP", "FSDP2", "FSDP1", "plain", "groups")
MANAGED = ("DDP", "FSDP2", "FSDP1", "plain")  # the kinds register(..., manager=) is handed
_MESHES: dict = {}  # the 2-D mesh of the "groups" kind, made once in the gloo group of one


def _mesh(kind: str):
    """The mesh register() is handed for ``kind`` (None but for "groups")."""
    if kind != "groups":
        return None
    if "groups" not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES["groups"] = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    return _MESHES["groups"]


def _config(combo: tuple[str, ...]) -> dict:
    out: dict = {}
    for item in combo:
        out.update(FRAGMENTS[item])
    return out


class OneReplicaManager:
    """What commpress asks of a ``torchft.Manager``, for one replica over this process's
    gloo group of one: every quorum is this replica alone, and a step commits unless a
    collective failed (as torchft's does)."""

    def __init__(self) -> None:
        self._pg = dist.group.WORLD
        self._timeout = timedelta(seconds=120)
        self._step = 0
        self._error: Exception | None = None

    def current_step(self) -> int:
        return self._step

    def register_state_dict_fn(self, key, load, save) -> None:
        pass

    def start_quorum(self, *args, **kwargs) -> None:
        self._error = None

    def wait_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return 1

    def is_participating(self) -> bool:
        return True

    def participating_rank(self) -> int:
        return 0

    def errored(self) -> Exception | None:
        return self._error

    def report_error(self, exc: Exception) -> None:
        self._error = exc

    def should_commit(self, *args, **kwargs) -> bool:
        committed = self._error is None
        self._step += committed
        return committed

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass


def _model(kind: str, managed: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    if kind == "DDP" and managed:
        from commpress.hooks import managed_ddp

        return managed_ddp(model)
    if kind == "DDP":
        return torch.nn.parallel.DistributedDataParallel(model)
    if kind == "FSDP1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    if kind in ("FSDP2", "groups"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,)) if kind == "FSDP2" else _mesh(kind)["shard"]
        fully_shard(model[0], mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return model


def _flat(model: torch.nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1) for p in model.parameters()])


def _parts_present(reg: commpress.Registration, combo: tuple[str, ...]) -> dict[str, bool]:
    """Each item of ``combo``: whether its part of ``reg`` carries it, after three steps."""
    onebit = reg.onebit_adam.average if reg.onebit_adam is not None else None  # where its momenta are averaged
    hook, averaging = reg.hook, reg.local_sgd or onebit or reg.groups_hook
    if hook is None and hasattr(averaging, "comm"):  # 1-bit Adam under a manager averages through its DDP hook
        hook = averaging.comm
    method = hook.compressors["main"].name if hook is not None else averaging.averager.method if averaging else None
    if reg.dion is not None:  # the other parameters' gradients go through the method
        dion = reg.dion.iteration  # at Muon's step, or in the backward under a manager
        method = dion.rest.method if hasattr(dion, "rest") else dion.comm.compressors["main"].name
    checks = {
        "method": lambda: method == "topk",
        "overrides": lambda: "override0" in hook.compressors,
        "start_iter": lambda: hook.config.start_iter == 1 and getattr(hook, "steps", hook.step) == 3,
        "bandwidth": lambda: hook.adaptive.plan is not None,
        # under [bandwidth] the plan is made per cross group, and one rank has none: nothing to plan
        "layerwise": lambda: hook.plan is not None if hook.adaptive is None else hook.layerwise.per_link,
        "local_sgd": lambda: reg.local_sgd.traffic.bytes_sent > 0,  # period 1: a round at each step
        "onebit_adam": lambda: reg.onebit_adam.frozen,  # warm-up of 1: the second step is 1-bit Adam's
        "dion": lambda: reg.dion.steps == 3,
        "fsdp": lambda: reg.fsdp is not None,
    }
    out = {}
    for item in combo:
        try:
            out[item] = bool(checks[item]())
        except AttributeError:  # the part that carries the item is missing
            out[item] = False
    return out


def _optimizer(model: torch.nn.Module, combo: tuple[str, ...]):
    """AdamW over every parameter; with [dion], Muon over the first layer's matrix and AdamW
    over the rest (Dion takes over Muon's step) where the layer holds one (FSDP1 flattens it)."""
    params = list(model.parameters())
    if "dion" not in combo or params[0].ndim != 2:
        return torch.optim.AdamW(params, lr=1e-2)
    return HybridOptimizer([torch.optim.Muon(params[:1], lr=1e-2), torch.optim.AdamW(params[1:], lr=1e-2)])


def _case(kind: str, combo: tuple[str, ...], managed: bool = False) -> dict:
    """register() with ``combo`` on a fresh model of ``kind`` (under a manager of one replica:
    ``managed``), then three training steps; under a manager each is a manager step, as
    torchft's ``OptimizerWrapper`` makes it, but for [local_sgd], whose syncs are."""
    model = _model(kind, managed)
    opt = _optimizer(model, combo)
    manager = OneReplicaManager() if managed else None
    try:
        reg = commpress.register(model, _config(combo), optimizer=opt, total_steps=3, mesh=_mesh(kind), manager=manager)
    except ConfigError as exc:
        return {"refused": str(exc)}
    before = _flat(model).clone()
    data = torch.Generator().manual_seed(1)
    losses = []
    steps = manager if managed and reg.local_sgd is None else None
    for _ in range(3):
        if steps is not None:
            steps.start_quorum()
        loss = model(torch.randn(4, 8, generator=data)).square().mean()
        opt.zero_grad()
        loss.backward()
        if steps is None or steps.should_commit():
            opt.step()
        losses.append(loss.item())
    reg.finish()
    return {
        "parts": sorted(p.name for p in reg.parts),
        "present": _parts_present(reg, combo),
        "finite": all(math.isfinite(x) for x in losses),
        "moved": not torch.equal(before, _flat(model)),
    }


def _entry_points(kind: str, combo: tuple[str, ...]) -> dict:
    """What the lower-level entry points say to ``combo``: None where they accept it."""
    from commpress.hooks import register_ddp_hook
    from commpress.local_sgd import from_config

    def said(fn) -> str | None:
        try:
            fn()
        except ConfigError as exc:
            return str(exc)
        return None

    config = _config(combo)
    model = _model(kind)
    out = {"fsdp.apply": said(lambda: commpress.fsdp.load_fsdp_config(config))}
    if kind == "DDP":
        out["register_ddp_hook"] = said(lambda: register_ddp_hook(model, config))
        out["CommState"] = said(lambda: commpress.CommState(config, model=model.module))
    if "local_sgd" in combo:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        out["from_config"] = said(lambda: from_config(model, optimizer, config, mesh=_mesh(kind)))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every case: the single process first, then the distributed kinds in a gloo group of
    one in this process (torch.distributed is taken down again after)."""
    assert not dist.is_initialized()
    register = {("single", combo): _case("single", combo) for combo in COMBOS}
    store = tmp_path_factory.mktemp("matrix") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        register.update({(kind, combo): _case(kind, combo) for kind in DISTRIBUTED for combo in COMBOS})
        managed = {(kind, combo): _case(kind, combo, managed=True) for kind in MANAGED for combo in COMBOS}
        entries = {(kind, combo): _entry_points(kind, combo) for kind in ("DDP", "FSDP2", "plain", "groups") for combo in COMBOS}
    finally:
        _MESHES.clear()
        dist.destroy_process_group()
    return {"register": register, "entries": entries, "managed": managed}


def _assert_names(message: str, items: tuple[str, ...], kind: str) -> None:
    for item in items:
        assert label(item) in message, f"{label(item)} not named in: {message}"
    assert KINDS[kind] in message, f"{KINDS[kind]} not named in: {message}"


def _check_outcome(outcome: dict, refused: tuple[str, ...] | None, kind: str, combo: tuple[str, ...], seen: Counter) -> None:
    """``outcome`` is what the matrix says: applied whole and trained, or refused naming ``refused``."""
    if refused is None:
        assert "refused" not in outcome, f"{combo} on {kind}: {outcome.get('refused')}"
        if kind != "single":  # nothing applies in a single process
            assert all(outcome["present"].values()), f"{combo} on {kind}: parts {outcome['parts']}, {outcome['present']}"
        assert outcome["finite"] and outcome["moved"], f"{combo} on {kind} did not train: {outcome}"
        assert len(outcome["parts"]) == (0 if kind == "single" else 1)
        seen["applied"] += 1
    else:
        assert "refused" in outcome, f"{combo} on {kind} was applied ({outcome['parts']}); the matrix refuses {refused}"
        assert set(refused) <= set(combo)
        _assert_names(outcome["refused"], refused, kind)
        seen["refused"] += 1


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", KINDS)
def test_every_combination_is_applied_whole_or_refused_naming_the_items(runs, kind):
    seen = Counter()
    for combo in COMBOS:
        refused = refused_items(Config.load(_config(combo)), kind)
        _check_outcome(runs["register"][(kind, combo)], refused, kind, combo, seen)
    assert seen["applied"] and (seen["refused"] or kind == "single"), seen


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", MANAGED)
def test_under_a_manager_every_combination_is_applied_whole_or_refused_naming_the_items(runs, kind):
    """The same under a torchft Manager: what runs there (the DDP hook but [bandwidth] on a
    model of managed_ddp, 1-bit Adam on one, [local_sgd] on it, a plain module or FSDP2
    within the replica group; never backend = 'mpi') is applied whole, the rest refused."""
    seen = Counter()
    for combo in COMBOS:
        refused = refused_items(Config.load(_config(combo)), kind, managed=True)
        outcome = runs["managed"][(kind, combo)]
        _check_outcome(outcome, refused, kind, combo, seen)
        if refused is not None:
            assert "under a torchft Manager" in outcome["refused"], outcome["refused"]
    assert seen["refused"] and (seen["applied"] or kind == "FSDP1"), seen


@pytest.mark.multiproc
def test_the_issue_cases_are_refused(runs):
    """A table dropped without a word (issue 40): [onebit_adam] beside [local_sgd], and on sharded models."""
    assert "[local_sgd] and [onebit_adam]" in runs["register"][("DDP", ("local_sgd", "onebit_adam"))]["refused"]
    assert "[local_sgd] and [onebit_adam]" in runs["register"][("DDP", ("method", "local_sgd", "onebit_adam"))]["refused"]
    for kind in ("FSDP2", "FSDP1"):
        assert "[fsdp] and [onebit_adam] cannot apply" in runs["register"][(kind, ("fsdp", "onebit_adam"))]["refused"]
    # the matrix's shape: [fsdp] only on sharded models, the DDP hook's items only on DDP
    for kind in DISTRIBUTED:
        assert ("refused" in runs["register"][(kind, ("fsdp",))]) == (kind not in ("FSDP2", "FSDP1"))
        assert ("refused" in runs["register"][(kind, ("method", "bandwidth"))]) == (kind != "DDP")


@pytest.mark.multiproc
def test_the_lower_level_entry_points_follow_the_matrix(runs):
    for (kind, combo), said in runs["entries"].items():
        config = Config.load(_config(combo))
        on_ddp = refused_items(config, "DDP") is None and not {"local_sgd", "onebit_adam", "dion", "fsdp"} & set(combo)
        if kind == "DDP":
            assert (said["CommState"] is None) == on_ddp, (combo, said["CommState"])
            assert said["register_ddp_hook"] == said["CommState"], combo
        if "local_sgd" in combo:
            expected = refused_items(config, kind)
            assert (said["from_config"] is None) == (expected is None), (kind, combo, said)
        takes_fsdp = set(combo) <= {"fsdp"}
        assert (said["fsdp.apply"] is None) == takes_fsdp, (combo, said["fsdp.apply"])
        for message in filter(None, said.values()):
            assert re.search(r"\[\w+\]|method|overrides|start_iter", message), message


def test_commstate_names_where_another_table_applies():
    where = r"apply \[onebit_adam\] with commpress\.register\(ddp_model, config, optimizer=adamw\)"
    with pytest.raises(ConfigError, match=where):
        commpress.CommState({"method": "none", "onebit_adam": {"warmup": 1}})


@pytest.mark.parametrize(
    ("kind", "combo", "refused"),
    [
        ("DDP", (), False),
        ("DDP", ("method", "overrides", "layerwise"), False),
        ("DDP", ("local_sgd",), False),
        ("DDP", ("onebit_adam",), False),
        ("plain", ("local_sgd",), False),
        ("groups", ("local_sgd",), True),
        ("DDP", ("method", "bandwidth"), True),
        ("FSDP2", ("fsdp",), True),
        ("FSDP1", ("fsdp",), True),
    ],
)
def test_the_mpi_backend_is_refused_where_the_matrix_says(kind, combo, refused):
    """``backend = 'mpi'``: refused on sharded models and with [bandwidth], before any MPI
    call, naming it (applying it needs an MPI launch: tests/test_mpi.py)."""
    config = Config.load({**_config(combo), "backend": "mpi"})
    if not refused:
        assert matrix.part_for(config, kind) is not None and refused_items(config, kind) is None
        return
    with pytest.raises(ConfigError) as err:
        matrix.part_for(config, kind)
    assert "backend" in refused_items(config, kind)
    _assert_names(str(err.value), refused_items(config, kind), kind)


def test_the_docs_tables_are_the_matrix():
    assert matrix.rst_table() in commpress.registration.__doc__
    assert matrix.markdown_table() in (ROOT / "README.md").read_text()


def test_every_item_is_enumerated():
    assert set(FRAGMENTS) | {"backend"} == set(ITEMS)
