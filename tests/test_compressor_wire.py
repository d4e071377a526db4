"""Every compressor's own model of what it sends and of its knob: ``transfers`` against the
bytes the backend counts for a real reduction, ``params_for_ratio`` against its stated
bound, ``adapt_state`` when the knob moves."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch

from commpress.comm import SimulatedWorld
from commpress.compressors import (
    AllGather,
    AllReduce,
    Bucket,
    Compressor,
    Context,
    ParamSlot,
    Reduction,
    Transfer,
    available,
    build,
    compressor_class,
)
from commpress.compressors.lowrank import LowRankCompressor
from commpress.compressors.quant import QuantCompressor
from commpress.compressors.topk import TopKCompressor
from commpress.compressors.wire.collectives import ReduceScatter

# other test modules register test-only compressors; these are the package's own
METHODS = [m for m in available() if not m.startswith("test-")]
#: settings beside the defaults that change what a method sends
PARAMS = {
    "powersgd": [{"rank": 2}, {"rank": 8, "min_compression_rate": 0.0}],
    "acpsgd": [{"rank": 3}, {"rank": 2, "warm_start": False}, {"warm_start": False}],
    "topk": [
        {"ratio": 0.05},
        {"ratio": 0.2, "min_numel": 0, "value_dtype": "bfloat16"},
        {"ratio": 0.1, "value_dtype": "float16"},
        {"ratio": 0.1, "min_numel": 0, "value_bits": 2},
        {"ratio": 0.05, "value_bits": 8},
    ],
    "terngrad": [{"clip_sigma": 0.0}],
    "quant": [{"bits": 2, "min_numel": 0, "bucket_size": 64}, {"bits": 4, "error_feedback": True, "min_numel": 40}],
}
CASES = [(m, p) for m in METHODS for p in [{}, *PARAMS.get(m, [])]]
STEPS = 4  # ACP-SGD alternates P and Q steps: its model is their mean


def slots(*named: tuple[str, tuple[int, ...]]) -> tuple[ParamSlot, ...]:
    out, offset = [], 0
    for name, shape in named:
        out.append(ParamSlot(name, torch.Size(shape), offset))
        offset += out[-1].numel
    return tuple(out)


LAYOUT = slots(("w", (48, 40)), ("b", (48,)), ("conv", (16, 3, 5, 5)), ("wide", (6, 300)), ("row", (1, 9)), ("tiny", (3, 3)))


def test_the_package_registers_its_methods():
    assert {"none", "fp16", "bf16", "powersgd", "acpsgd", "topk", "terngrad"} <= set(METHODS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("method", "params"), CASES)
def test_a_compressors_transfers_are_what_the_backend_counts(method, params, dtype):
    """Run the method on a simulated world for several steps: each rank's counted bytes and
    collectives per step are the compressor's own ``transfers`` for the bucket."""
    world_size = 3
    world = SimulatedWorld(world_size)
    comps = [build(method, params) for _ in range(world_size)]
    n = sum(s.numel for s in LAYOUT)
    gen = torch.Generator().manual_seed(7)
    for step in range(STEPS):
        buckets = [Bucket(0, torch.randn(n, generator=gen).to(dtype), LAYOUT) for _ in range(world_size)]
        world.reduce(comps, buckets, step=step)
        for c in comps:
            c.end_step(True)
    model = comps[0].transfers(LAYOUT, dtype.itemsize)
    assert model is not None, f"{method} does not model its transfers"
    for traffic in world.traffic:
        assert traffic.bytes_sent / STEPS == sum(t.nbytes for t in model)
        assert traffic.collectives / STEPS == len(model)


@pytest.mark.parametrize(("method", "params"), CASES)
def test_transfers_are_the_sum_of_every_slots_own(method, params):
    c = build(method, params)
    per_slot = [c.slot_transfers(s, 4) for s in LAYOUT]
    assert all(t is not None and len(t) == len(per_slot[0]) for t in per_slot)
    whole = c.transfers(LAYOUT, 4)
    assert [t.kind for t in whole] == [t.kind for t in per_slot[0]][: len(whole)]
    assert [t.nbytes for t in whole] == [sum(ts[i].nbytes for ts in per_slot) for i in range(len(whole))]
    assert c.transfers((), 4) == ()


class _Unmodelled(Compressor):
    name: ClassVar[str] = "test-wire-unmodelled"

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        yield AllReduce(bucket.buffer)


def test_the_defaults_model_nothing_and_have_no_knob():
    c = _Unmodelled()
    assert c.slot_transfers(LAYOUT[0], 4) is None and c.transfers(LAYOUT, 4) is None
    assert c.params_for_ratio(0.1, LAYOUT) == {}
    state = {"x": 1}
    assert c.adapt_state(state, _Unmodelled()) is state


def test_transfer_of_a_collective():
    t = torch.zeros(10)
    assert Transfer.of(AllReduce(t)) == Transfer("all_reduce", 40)
    assert Transfer.of(AllGather(t.half())) == Transfer("all_gather", 20)
    assert Transfer.of(ReduceScatter(t)) == Transfer("all_to_all", 40)


# ---- a target ratio and the bytes it gives

# matrices that every rank the mappings give below compresses, at full rank
MATRICES = slots(("a", (64, 96)), ("b", (128, 48)), ("c", (40, 8, 3, 3)))
RATIOS = [0.003, 0.01, 0.05, 0.1, 0.2, 0.3]


def _bytes(method: str, params: dict, layout=MATRICES) -> float:
    return sum(t.nbytes for t in build(method, params).transfers(layout, 4))


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize(("method", "params"), CASES)
def test_a_target_ratio_gives_bytes_within_the_methods_bound(method, params, ratio):
    """Low-rank: the factors carry at most ``ratio`` of the float32 bytes, one rank more
    would carry more (or the rank is 1). Top-k: at least ``ratio``, less than one entry per
    tensor more (with ``value_bits``, also the tensor's (min, scale) and a byte of padding).
    quant: at most ``ratio`` (or 2 bits), the next bits up more. Methods without a knob keep
    their parameters."""
    if issubclass(compressor_class(method), LowRankCompressor):
        params = {**params, "min_compression_rate": 0.0}
    if method in ("topk", "quant"):
        params = {**params, "min_numel": 0}
    c = build(method, params)
    change = c.params_for_ratio(ratio, MATRICES)
    target = ratio * 4 * sum(s.numel for s in MATRICES)
    if isinstance(c, LowRankCompressor):
        assert set(change) == {"rank"}
        rank = change["rank"]
        assert rank < min(min(s.shape[0], s.numel // s.shape[0]) for s in MATRICES)  # no rank is clipped
        assert _bytes(method, {**params, **change}) <= target or rank == 1
        assert _bytes(method, {**params, "rank": rank + 1}) > target
    elif isinstance(c, TopKCompressor):
        assert set(change) == {"ratio"}
        entry = 4 + c.value_dtype.itemsize if c.value_bits is None else 4 + c.value_bits / 8 + 8 + 1
        assert target - 1e-6 <= _bytes(method, {**params, **change}) < target + entry * len(MATRICES)
    elif isinstance(c, QuantCompressor):
        assert set(change) == {"bits"}
        bits = change["bits"]
        assert _bytes(method, {**params, **change}) <= target or bits == 2
        assert bits == 8 or _bytes(method, {**params, "bits": bits * 2}) > target
    else:
        assert change == {}, f"{method} has a knob: state its bound and check it here"


@pytest.mark.parametrize("method", ["powersgd", "acpsgd", "topk", "quant"])
def test_the_mapping_grows_with_the_ratio(method):
    base = {"min_numel": 0} if method in ("topk", "quant") else {}
    sent = [_bytes(method, {**base, **build(method, base).params_for_ratio(r, MATRICES)}) for r in RATIOS]
    assert sent == sorted(sent) and sent[0] < sent[-1]


def test_one_slots_own_setting():
    """A per-tensor plan asks the mapping for one slot at a time."""
    c = build("powersgd", {})
    a, b = MATRICES[0], MATRICES[1]
    assert c.params_for_ratio(0.1, [a]) == {"rank": math.floor(0.1 * 64 * 96 / (64 + 96))}
    assert c.params_for_ratio(0.1, [b]) == {"rank": math.floor(0.1 * 128 * 48 / (128 + 48))}
    topk = build("topk", {"value_dtype": "float16"})
    assert topk.params_for_ratio(0.06, [a]) == topk.params_for_ratio(0.06, [b]) == {"ratio": pytest.approx(0.04)}


def test_low_rank_state_follows_the_effective_rank():
    err = torch.ones(2, 3)
    state = {"error": {"w": err}, "q": {"w": torch.ones(4, 3)}, "p": {"w": torch.ones(2, 4)}}
    assert build("powersgd", {"rank": 4}).adapt_state(state, build("powersgd", {})) is state  # 4 is the default
    new = build("acpsgd", {"rank": 2}).adapt_state(state, build("acpsgd", {"rank": 4}))
    assert new["error"]["w"] is err and new["q"] == {} and new["p"] == {}
