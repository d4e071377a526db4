"""Every state a user may hand to a framework pickles, before and after use, or refuses clearly.

Hook states (the DDP hook's ``CommState`` for several methods, FSDP1's ``QuantizedState``
and ``LowPrecisionState``) are built here, before any process group, and reach the 2 ranks
pickled (``run_local`` spawns them, as Lightning's ``ddp_spawn`` does). In every rank:

* before use: the pickled state trains a new model bit for bit as a state built in the rank does;
* after use: the state pickled at step ``SAVE_AT`` (with the model and optimizer) continues
  to ``STEPS`` bit for bit as the uninterrupted run does; for Top-k and FSDP1's quantization
  a fresh state there differs (the control: the comparison can fail).

Trainers bound to the process's model and optimizer (Local SGD, CO2, DiLoCo, 1-bit Adam, the
parameter averager, FSDP2's state) refuse to pickle, naming what to save instead; so do a
hook state of a subgroup and a ``CommState`` built with ``model=`` before its first bucket.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from commpress import CommState, ddp_hook, register
from commpress.bench.launch import run_local
from commpress.fsdp import FSDPConfig, LowPrecisionState, QuantizedState, low_precision_hook, quantized_hook

pytestmark = pytest.mark.multiproc

STEPS, SAVE_AT = 6, 3
TOPK = {"ratio": 0.1, "min_numel": 0}
HOOKS = {  # name -> config of a DDP hook state
    "none": {"method": "none"},
    "fp16": {"method": "fp16"},
    "powersgd": {"method": "powersgd", "params": {"rank": 2, "min_compression_rate": 0}},
    "topk": {"method": "topk", "params": TOPK},  # error feedback: per-rank state
    "quant-ef": {"method": "quant", "params": {"bits": 2, "error_feedback": True, "min_numel": 0, "bucket_size": 8}},
    "layerwise": {"method": "topk", "params": TOPK, "layerwise": {"enabled": True, "every": 2}},
}
Q8 = FSDPConfig(grad_bits=8, min_numel=0, exclude=())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own data
        F.mse_loss(model(torch.randn(16, 12, generator=g)), torch.randn(16, 4, generator=g)).backward()
        opt.step()
        opt.zero_grad()


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _roundtrip(obj):
    return pickle.loads(pickle.dumps(obj))


def _ddp_runs(rank: int, state: CommState, config: dict) -> dict[str, bool]:
    """The hook ``state`` pickled into this rank, against a state built here; the state
    pickled at SAVE_AT, against the run that went on."""
    from torch.nn.parallel import DistributedDataParallel

    def fit(hook_state, steps, start=None):
        ddp = DistributedDataParallel(_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        if start is not None:
            ddp.module.load_state_dict(start["model"])
            opt.load_state_dict(start["optimizer"])
        ddp.register_comm_hook(hook_state, ddp_hook)
        _train(ddp, opt, rank, steps)
        return ddp, opt

    here = CommState(config)
    ddp, opt = fit(here, range(SAVE_AT))
    saved = _roundtrip({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(), "hook": here})
    _train(ddp, opt, rank, range(SAVE_AT, STEPS))
    straight = _params(ddp.module)
    before, _ = fit(state, range(STEPS))
    after, _ = fit(saved["hook"], range(SAVE_AT, STEPS), saved)
    fresh, _ = fit(CommState(config), range(SAVE_AT, STEPS), saved)
    return {
        "before": torch.equal(_params(before.module), straight),
        "after": torch.equal(_params(after.module), straight),
        "fresh_differs": not torch.equal(_params(fresh.module), straight),
        "sent": state.traffic.bytes_sent > 0 and saved["hook"].traffic.bytes_sent > 0,
        "steps": saved["hook"].step == STEPS,
    }


class _Swappable:
    """An FSDP1 hook state that can be replaced between steps (FSDP1 takes one hook, once)."""

    def __init__(self, state, hook) -> None:
        self.state, self.hook = state, hook

    @staticmethod
    def run(holder: _Swappable, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
        holder.hook(holder.state, grad, output)


def _fsdp1_run(rank: int, state, hook, swap=None) -> torch.Tensor:
    """STEPS of FSDP1 (FULL_SHARD, CPU) with ``hook(state)``; ``swap(state)`` replaces the state at SAVE_AT."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(_model(), device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    holder = _Swappable(state, hook)
    model.register_comm_hook(holder, _Swappable.run)
    _train(model, opt, rank, range(SAVE_AT))
    if swap is not None:
        holder.state = swap(holder.state)
    _train(model, opt, rank, range(SAVE_AT, STEPS))
    with FullyShardedDataParallel.summon_full_params(model):
        return _params(model)


def _fresh(state: QuantizedState) -> QuantizedState:
    return QuantizedState(state.config)


def _fsdp1_runs(rank: int, quantized: QuantizedState, low: LowPrecisionState) -> dict[str, bool]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    import commpress.fsdp

    straight = _fsdp1_run(rank, QuantizedState(Q8), quantized_hook)
    # the state commpress.fsdp.apply registers holds the model's process group (the world)
    applied = commpress.fsdp.apply(FullyShardedDataParallel(_model(), device_id=torch.device("cpu")), Q8)
    return {
        "before": torch.equal(_fsdp1_run(rank, quantized, quantized_hook), straight),
        "after": torch.equal(_fsdp1_run(rank, QuantizedState(Q8), quantized_hook, swap=_roundtrip), straight),
        "fresh_differs": not torch.equal(_fsdp1_run(rank, QuantizedState(Q8), quantized_hook, swap=_fresh), straight),
        "sent": quantized.traffic.bytes_sent > 0,
        "low_before": torch.equal(
            _fsdp1_run(rank, low, low_precision_hook), _fsdp1_run(rank, LowPrecisionState(torch.bfloat16), low_precision_hook)
        ),
        "applied_pickles": _roundtrip(applied).config == Q8,
    }


def _refusals(rank: int) -> dict[str, str]:
    """Each bound trainer's (and a subgroup state's) pickling error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import commpress.fsdp

    objects = {}
    for algorithm in ("local_sgd", "co2", "diloco"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        objects[algorithm] = register(model, {"local_sgd": {"algorithm": algorithm, "period": 2}}, optimizer=opt).local_sgd
    objects["averager"] = objects["local_sgd"].averager
    ddp = DistributedDataParallel(_model())
    adamw = torch.optim.AdamW(ddp.parameters())
    objects["onebit_adam"] = register(ddp, {"onebit_adam": {"warmup": 1}}, optimizer=adamw).onebit_adam
    sharded = _model()
    fully_shard(sharded, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    objects["fsdp2"] = commpress.fsdp.apply(sharded, Q8)
    subgroup = dist.new_group([0, 1])
    objects["subgroup_comm"] = CommState({"method": "fp16"}, process_group=subgroup)
    objects["subgroup_fsdp1"] = QuantizedState(Q8, process_group=subgroup)
    out = {}
    for name, obj in objects.items():
        try:
            pickle.dumps(obj)
            out[name] = "pickled"
        except TypeError as exc:
            out[name] = str(exc)
    return out


def _ranks(rank: int, world: int, hooks: dict[str, CommState], quantized: QuantizedState, low: LowPrecisionState) -> dict:
    return {
        "ddp": {name: _ddp_runs(rank, state, HOOKS[name]) for name, state in hooks.items()},
        "fsdp1": _fsdp1_runs(rank, quantized, low),
        "refusals": _refusals(rank),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    hooks = {name: CommState(config) for name, config in HOOKS.items()}  # no process group yet: pickled into the ranks
    return run_local(_ranks, 2, hooks, QuantizedState(Q8), LowPrecisionState(torch.bfloat16))


@pytest.mark.parametrize("name", list(HOOKS))
def test_a_comm_state_pickled_before_or_after_use_trains_exactly_as_one_never_pickled(ranks, name):
    for rank, out in enumerate(ranks):
        got = out["ddp"][name]
        assert got["sent"] and got["steps"], f"rank {rank}: the pickled states did not reduce every step"
        assert got["before"], f"rank {rank}: the state pickled before use trained differently"
        assert got["after"], f"rank {rank}: the state pickled at step {SAVE_AT} did not continue exactly"


@pytest.mark.parametrize("name", ["topk", "quant-ef", "layerwise"])
def test_without_the_pickled_state_the_continuation_differs(ranks, name):
    assert all(out["ddp"][name]["fresh_differs"] for out in ranks)


def test_fsdp1_hook_states_pickle_before_and_after_use(ranks):
    for rank, out in enumerate(ranks):
        got = out["fsdp1"]
        assert got["sent"], f"rank {rank}: the pickled QuantizedState sent nothing"
        assert got["before"] and got["low_before"], f"rank {rank}: a state pickled before use trained differently"
        assert got["after"], f"rank {rank}: the QuantizedState pickled at step {SAVE_AT} did not continue exactly"
        assert got["fresh_differs"], f"rank {rank}: the control (a fresh state at step {SAVE_AT}) did not differ"
        assert got["applied_pickles"]


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("local_sgd", "LocalSGD"),
        ("co2", "CO2"),
        ("diloco", "DiLoCo"),
        ("averager", "ParameterAverager"),
        ("onebit_adam", "OneBitAdam"),
        ("fsdp2", "FSDP2State"),
    ],
)
def test_trainers_bound_to_the_process_refuse_to_pickle_naming_state_dict(ranks, name, kind):
    for out in ranks:
        message = out["refusals"][name]
        assert message.startswith(f"{kind} does not pickle") and "state_dict()" in message, message


@pytest.mark.parametrize("name", ["subgroup_comm", "subgroup_fsdp1"])
def test_a_hook_state_of_a_subgroup_refuses_to_pickle(ranks, name):
    for out in ranks:
        assert "of a process group other than the default one does not pickle" in out["refusals"][name]


def test_a_comm_state_built_with_a_model_refuses_to_pickle_before_its_first_bucket():
    config = {"method": "fp16", "overrides": [{"params": ["2.*"], "method": "none"}]}
    state = CommState(config, model=_model())
    with pytest.raises(TypeError, match=r"built with model= pickles only after its first reduction"):
        pickle.dumps(state)
    assert _roundtrip(CommState({"method": "fp16"})).config == state.config.__class__.load({"method": "fp16"})


def test_traffic_counters_pickle():
    from commpress.comm import Traffic

    traffic = Traffic()
    traffic.add(nbytes=7, collectives=2, seconds=0.5)
    copy = _roundtrip(traffic)
    copy.add(nbytes=1)
    assert copy.snapshot() == {"bytes_sent": 8, "collectives": 2, "compute_seconds": 0.5}
    assert traffic.bytes_sent == 7  # the original is untouched
