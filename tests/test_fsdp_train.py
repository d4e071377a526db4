"""FSDP2 and FSDP1 with commpress's quantized collectives, in real gloo processes (2 and 4 ranks).

Every training run uses the same model, seed and data; each rank returns its final full
parameters, losses and per-step traffic.
"""

from __future__ import annotations

import math

import pytest
import torch

from commpress.bench.launch import run_local
from commpress.workloads.charlm import CharTask

pytestmark = pytest.mark.multiproc

STEPS = 30
HIDDEN = 256
TASK = CharTask(batch_size=32)
OFF = {"weight_bits": 32, "grad_bits": 32}
Q8 = {"weight_bits": 8, "grad_bits": 8}  # default exclusions: embedding and biases stay fp32
Q4_ALL = {"weight_bits": 4, "grad_bits": 4, "bucket_size": 256, "exclude": [], "min_numel": 0}


def _lowp(model):
    from commpress.fsdp import LowPrecisionState, low_precision_hook

    model.register_comm_hook(LowPrecisionState(torch.bfloat16), low_precision_hook)


def _reduce_scatter_statistics(rank: int, world: int) -> dict:
    """Call the FSDP2 reduce-scatter directly on known inputs: one call must land within the
    quantization error of the exact average; the mean of many calls (fresh seeds each) must
    approach it (unbiased)."""
    import torch.distributed as dist

    from commpress.fsdp import FSDPConfig, QuantizedReduceScatter
    from commpress.fsdp.fsdp2 import ParamShard, Unit

    n, bits, bucket, k = 2048, 2, 256, 200
    unit = Unit(0, (ParamShard("w", n * world, n),), FSDPConfig(grad_bits=bits, bucket_size=bucket, min_numel=0))
    rs = QuantizedReduceScatter(unit)

    def rows(r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 + r)
        return (torch.randn(world * n, generator=g) * (r + 1)).view(world, n)

    mine = [rows(r)[rank] for r in range(world)]  # every rank's row destined to this rank
    exact = torch.stack(mine).double().mean(0)
    steps = torch.stack([(m.view(-1, bucket).amax(1) - m.view(-1, bucket).amin(1)) / (2**bits - 1) for m in mine])
    step_bound = steps.double().mean(0).repeat_interleave(bucket)  # |avg error| <= mean of the ranks' steps
    out = torch.empty(n)
    total = torch.zeros(n, dtype=torch.float64)
    first = None
    for _ in range(k):
        rs(out, rows(rank).reshape(-1).clone(), dist.group.WORLD, dist.ReduceOp.AVG)
        first = out.clone() if first is None else first
        total += out.double()
    rs(out, rows(rank).reshape(-1).clone(), dist.group.WORLD, dist.ReduceOp.SUM)
    # the mean of k calls: per-rank errors are independent, each with variance <= step^2/4
    sigma = torch.sqrt((steps.double() ** 2 / 4).sum(0) / world**2 / k).repeat_interleave(bucket)
    return {
        "single": ((first.double() - exact).abs() / step_bound).max().item(),
        "sum": ((out.double() - world * exact).abs() / (world * step_bound)).max().item(),
        "z": ((total / k - exact).abs() / sigma).max().item(),
        "bytes": unit.scatter_traffic.snapshot()["bytes_sent"] / (k + 1),
    }


def _errors(rank: int, world: int) -> dict:
    """Clear errors for what the hooks cannot do (each rank reaches the same ones)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    import commpress.fsdp

    out = {}
    mesh = init_device_mesh("cpu", (world,))
    other = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu"), shard_mesh_dim=0)
    base = FSDPMeshInfo(mesh, shard_mesh_dim=0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    # biases on another mesh: two parameter groups in one module
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other if p.dim() == 1 else base))
    try:
        commpress.fsdp.apply(model, Q8)
    except ValueError as exc:
        out["groups"] = str(exc)
    inner = FullyShardedDataParallel(torch.nn.Linear(8, 8), device_id=torch.device("cpu"))
    outer = FullyShardedDataParallel(torch.nn.Sequential(inner, torch.nn.Linear(8, 8)), device_id=torch.device("cpu"))
    outer(torch.zeros(2, 8)).sum().backward()  # lazy init decides which instance is the root
    try:
        commpress.fsdp.apply(inner, Q8)
    except ValueError as exc:
        out["fsdp1_root"] = str(exc)
    try:
        commpress.fsdp.apply(torch.nn.Linear(8, 8), Q8, recurse=False)
    except TypeError as exc:
        out["not_sharded"] = str(exc)
    # last: a reduce-scatter that raises leaves this model's backward unfinished
    model = torch.nn.Linear(64, 64)
    fully_shard(model, mesh=mesh)
    commpress.fsdp.apply(model, {"grad_bits": 8, "min_numel": 0, "exclude": []})
    model.set_gradient_divide_factor(3.0)
    try:
        model(torch.ones(2, 64)).sum().backward()
    except ValueError as exc:
        out["divide_factor"] = str(exc)
    return out


def _two_ranks(rank: int, world: int) -> dict:
    from commpress.workloads.train_fsdp import train_fsdp

    kw = {"steps": STEPS, "hidden": HIDDEN, "task": TASK, "return_params": True}
    return {
        "plain": train_fsdp(None, **kw),
        "off": train_fsdp(OFF, **kw),
        "q8": train_fsdp(Q8, **kw),
        "q8_restart": train_fsdp(Q8, restart_at=STEPS // 2, **kw),
        "q4_all": train_fsdp(Q4_ALL, **kw),
        "fsdp1_plain": train_fsdp(None, version=1, **kw),
        "fsdp1_off": train_fsdp(OFF, version=1, **kw),
        "fsdp1_q8": train_fsdp(Q8, version=1, **kw),
        "fsdp1_bf16": train_fsdp(None, version=1, hook=_lowp, **kw),
        "fsdp1_noshard_q8": train_fsdp(Q8, version=1, strategy="NO_SHARD", **kw),
        "rs": _reduce_scatter_statistics(rank, world),
        "errors": _errors(rank, world),
    }


def _four_ranks(rank: int, world: int) -> dict:
    from commpress.workloads.train_fsdp import train_fsdp

    kw = {"steps": STEPS, "hidden": HIDDEN, "task": TASK, "return_params": True}
    return {
        "plain": train_fsdp(None, **kw),
        "off": train_fsdp(OFF, **kw),
        "q8": train_fsdp(Q8, **kw),
        "hsdp_plain": train_fsdp(None, mesh_shape=(2, 2), **kw),
        "hsdp_q8": train_fsdp(Q8, mesh_shape=(2, 2), **kw),
        "fsdp1_plain": train_fsdp(None, version=1, **kw),
        "fsdp1_off": train_fsdp(OFF, version=1, **kw),
        "rs": _reduce_scatter_statistics(rank, world),
    }


@pytest.fixture(scope="module")
def two():
    return run_local(_two_ranks, 2)


@pytest.fixture(scope="module")
def four():
    return run_local(_four_ranks, 4)


def _assert_close_curves(run, ref, tol=0.03):
    """Loss curves (means over windows of 5 steps) and the held-out loss within ``tol``."""
    for a, b in zip(_windows(run.losses), _windows(ref.losses)):
        assert abs(a - b) <= tol * b
    assert abs(run.eval_loss - ref.eval_loss) <= tol * ref.eval_loss


def _windows(losses, size=5):
    return [sum(losses[i : i + size]) / size for i in range(0, len(losses), size)]


def _same_on_all_ranks(runs, key):
    for r in runs[1:]:
        assert torch.equal(r[key].params, runs[0][key].params)


@pytest.mark.parametrize("fixture", ["two", "four"])
def test_quantization_off_equals_plain_fsdp(fixture, request):
    runs = request.getfixturevalue(fixture)
    for r in runs:
        assert torch.equal(r["off"].params, r["plain"].params)
        assert r["off"].losses == r["plain"].losses
        assert torch.equal(r["fsdp1_off"].params, r["fsdp1_plain"].params)


@pytest.mark.parametrize("fixture", ["two", "four"])
def test_8bit_weights_and_grads_keep_the_loss_curve(fixture, request):
    runs = request.getfixturevalue(fixture)
    _same_on_all_ranks(runs, "q8")  # every rank applies the same averaged update
    _assert_close_curves(runs[0]["q8"], runs[0]["plain"])
    assert not torch.equal(runs[0]["q8"].params, runs[0]["plain"].params)  # it did quantize


def test_fsdp1_hooks_keep_the_loss_curve(two):
    for key in ("fsdp1_q8", "fsdp1_bf16", "fsdp1_noshard_q8"):
        _same_on_all_ranks(two, key)
        _assert_close_curves(two[0][key], two[0]["fsdp1_plain"])


def test_hsdp_trains_and_replicas_agree(four):
    _same_on_all_ranks(four, "hsdp_q8")  # replicas gather identical quantized weights
    _assert_close_curves(four[0]["hsdp_q8"], four[0]["hsdp_plain"])


def test_resume_continues_bit_for_bit(two):
    for r in two:
        assert torch.equal(r["q8_restart"].params, r["q8"].params)
        assert r["q8_restart"].losses == r["q8"].losses
        assert r["q8_restart"].state == r["q8"].state


def _shard_numels(world):
    """Per FSDP unit of the test model, each parameter's padded shard size."""
    shapes = [[(128, 24)], [(HIDDEN, 32 * 24), (HIDDEN,)], [(HIDDEN, HIDDEN), (HIDDEN,)], [(128, HIDDEN), (128,)]]
    return [[math.ceil(s[0] / world) * math.prod(s[1:]) for s in unit] for unit in shapes]


def _payload(nq, bits, bucket, raw=0):
    """Bytes of one payload: bits/8 per quantized element, 8 per bucket (min and scale),
    raw elements at 4 bytes, padded to a multiple of 4."""
    return 4 * math.ceil((8 * math.ceil(nq / bucket) + 4 * raw + math.ceil(nq * bits / 8)) / 4)


@pytest.mark.parametrize("fixture", ["two", "four"])
def test_bytes_on_the_wire_match_the_formula(fixture, request):
    runs = request.getfixturevalue(fixture)
    world = len(runs)
    units = _shard_numels(world)
    full = sum(sum(u) for u in units)
    off = runs[0]["off"].traffic
    # plain: each unit gathered twice a step (forward, backward), reduce-scatter input = world shards
    assert off["all_gather"]["bytes_sent"] == 2 * 4 * full
    assert off["reduce_scatter"]["bytes_sent"] == world * 4 * full
    # Q8 with default exclusions: the embedding unit stays plain, biases travel raw
    ag = 2 * 4 * sum(units[0]) + sum(2 * _payload(u[0], 8, 1024, raw=u[1]) for u in units[1:])
    rs = world * 4 * sum(units[0]) + sum(world * (_payload(u[0], 8, 1024) + 4 * u[1]) for u in units[1:])
    assert runs[0]["q8"].traffic["all_gather"]["bytes_sent"] == ag
    assert runs[0]["q8"].traffic["reduce_scatter"]["bytes_sent"] == rs
    assert off["all_gather"]["bytes_sent"] / ag > 3.5  # about 4x fewer bytes at 8 bits
    if world == 2:
        q4 = runs[0]["q4_all"].traffic
        assert q4["all_gather"]["bytes_sent"] == sum(2 * _payload(sum(u), 4, 256) for u in units)
        assert q4["reduce_scatter"]["bytes_sent"] == sum(world * _payload(sum(u), 4, 256) for u in units)
        _same_on_all_ranks(runs, "q4_all")
        _assert_close_curves(runs[0]["q4_all"], runs[0]["plain"], tol=0.1)


@pytest.mark.parametrize("fixture", ["two", "four"])
def test_reduce_scatter_gives_each_rank_the_average_of_its_shard(fixture, request):
    world = 2 if fixture == "two" else 4
    for r in request.getfixturevalue(fixture):
        rs = r["rs"]
        assert rs["single"] <= 1.0 + 1e-5  # within the ranks' mean quantization step of the exact average
        assert rs["sum"] <= 1.0 + 1e-5  # ReduceOp.SUM: world times the average
        # unbiased: the mean of 200 calls is within 6 sigma for all 2048 elements (p ~ 4e-6)
        assert rs["z"] < 6
        assert rs["bytes"] == world * _payload(2048, 2, 256)


def test_clear_errors(two):
    errors = two[0]["errors"]
    assert "has 2 FSDP parameter groups" in errors["groups"] and "call fully_shard separately" in errors["groups"]
    assert "root FullyShardedDataParallel" in errors["fsdp1_root"]
    assert "expected a module sharded with fully_shard" in errors["not_sharded"]
    assert "set_gradient_divide_factor" in errors["divide_factor"]
