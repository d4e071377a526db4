"""Reductions that know from their decode whether the average is finite (their return value).

TernGrad and Top-k report it, so the hook skips its own pass over the bucket. The report
must never be wrong: when it is given it equals ``isfinite(average).all()``, on ordinary
gradients it is given, and a step it calls non-finite is discarded like one the hook's
check catches.
"""

from __future__ import annotations

import pytest
import torch

from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build, host
from commpress.compressors.composite import _combined
from commpress.compressors.wire.spans import SpanTensors
from commpress.hooks.state import CommState

METHODS = [
    ("terngrad", {}),
    ("terngrad", {"clip_sigma": 0.0}),
    ("topk", {"ratio": 0.05, "min_numel": 64}),
    ("topk", {"ratio": 0.05, "value_dtype": "float16"}),
    ("topk", {"ratio": 0.05, "dgc": True, "momentum": 0.9, "min_numel": 64}),
    ("topk", {"ratio": 0.05, "value_bits": 2, "min_numel": 64}),
    ("quant", {"min_numel": 64}),
    ("quant", {"bits": 2, "error_feedback": True, "min_numel": 0, "bucket_size": 64}),
]
SIZES = (300, 40, 9)
BIG = torch.finfo(torch.float32).max / 1.5  # two of these overflow a float32 sum


def _grads(world: int, dtype: torch.dtype, spoil: str | None) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = [[torch.randn(n, generator=g).to(dtype) for n in SIZES] for _ in range(world)]
    if spoil == "inf":
        out[1][0][5] = float("inf")
    elif spoil == "nan":
        out[0][2][1] = float("nan")
    elif spoil == "huge":  # finite gradients whose rank sum overflows float32 at element 0
        for ranks in out:
            ranks[0][0] = BIG
    elif spoil == "huge-small":  # the same in a tensor Top-k sends whole (fewer than min_numel)
        for ranks in out:
            ranks[2][0] = BIG
    return out


def _reduce(method: str, params: dict, grads: list[list[torch.Tensor]], steps: int = 1) -> list[tuple[Bucket, bool | None, dict]]:
    """Each rank's bucket after the last step, with what its reduction returned and its compressor's state."""
    world = len(grads)
    sim = SimulatedWorld(world)
    comps = sim.compressors(lambda: build(method, params))
    for step in range(steps):
        buckets = [Bucket.from_tensors(0, ts, [f"t{i}" for i in range(len(ts))]) for ts in grads]
        known = sim.reduce(comps, buckets, step=step)
        for c in comps:
            c.end_step(True)
    return list(zip(buckets, known, [c.state_dict() for c in comps]))


CASES = [(spoil, dtype) for spoil in (None, "inf", "nan") for dtype in (torch.float32, torch.float16, torch.bfloat16)]
CASES += [("huge", torch.float32), ("huge-small", torch.float32)]  # a float32 overflow: float32 buckets only


@pytest.mark.parametrize("method,params", METHODS)
@pytest.mark.parametrize("spoil,dtype", CASES)
def test_the_report_is_never_wrong(method, params, spoil, dtype):
    for b, known, _ in _reduce(method, params, _grads(2, dtype, spoil)):
        truth = bool(torch.isfinite(b.buffer).all())
        if known is not None:
            assert known == truth
        if spoil is None:
            assert known is True  # ordinary gradients: reported, so the hook skips its pass
        if spoil in ("inf", "nan"):
            assert known is False and not truth
        if spoil in ("huge", "huge-small"):  # finite inputs; an overflowing sum is left to the hook
            assert known is (True if truth else None)
            # TernGrad's clip at 2.5 root mean squares brings BIG into range in a tensor of 300
            # elements (not of 9): there the sums stay finite
            clipped = method == "terngrad" and params.get("clip_sigma", 2.5) > 0 and spoil == "huge"
            assert truth == clipped


DEVICE_PATH = [m for m in METHODS if m[0] == "terngrad"]


@pytest.mark.parametrize("method,params", DEVICE_PATH)
@pytest.mark.parametrize("spoil,dtype", CASES)
def test_on_a_gpu_the_check_stays_on_the_device_with_the_host_paths_bits_and_verdict(monkeypatch, method, params, spoil, dtype):
    """Where a host read waits for the device (``host.reads_stall``), TernGrad reads nothing and
    returns None; its average is the host path's bit for bit (NaN in the same places), so the
    hook's check of the buffer reaches the host path's verdict (and a finite step the same state)."""
    on_host = _reduce(method, params, _grads(2, dtype, spoil))
    monkeypatch.setattr(host, "reads_stall", lambda t: True)
    monkeypatch.setattr(host, "flags", lambda t: pytest.fail("a host read on the device path"))
    on_device = _reduce(method, params, _grads(2, dtype, spoil))
    for (a, known, state_a), (b, unknown, state_b) in zip(on_host, on_device, strict=True):
        assert unknown is None
        torch.testing.assert_close(b.buffer, a.buffer, rtol=0, atol=0, equal_nan=True)
        verdict = bool(torch.isfinite(b.buffer).all())
        assert verdict == (known if known is not None else bool(torch.isfinite(a.buffer).all()))
        if spoil is None:
            assert verdict
            torch.testing.assert_close(state_b, state_a, rtol=0, atol=0)


def test_the_device_path_spoils_only_the_non_finite_span_across_gaps():
    """Three spans, gaps before, between and after them, the middle one not finite: NaN there only."""
    buffer = torch.ones(18)
    SpanTensors().spoil(buffer, [(1, 5), (6, 3), (12, 4)], torch.tensor([True, False, True]))
    expected = torch.ones(18)
    expected[6:9] = float("nan")
    torch.testing.assert_close(buffer, expected, rtol=0, atol=0, equal_nan=True)


def test_top_k_values_that_overflow_a_half_bucket_are_not_reported_finite():
    # float32 residuals grow past float16's range while the bucket holds float16: the
    # average of the sent values may not fit the bucket, so the report must not be True
    grads = [[torch.full((256,), 60000.0, dtype=torch.float16)] for _ in range(2)]
    for b, known, _ in _reduce("topk", {"ratio": 0.01, "min_numel": 0}, grads, steps=3):
        assert not torch.isfinite(b.buffer).all()  # 2 x 60000 sent from the residual: past float16's 65504
        assert known is None  # finite values that do not fit: left to the hook's check


def test_parts_combine():
    assert _combined([True, True]) is True
    assert _combined([True, None]) is None
    assert _combined([None, False]) is False
    assert _combined([]) is None


def _states(config: dict, world: int = 2) -> list[CommState]:
    sim = SimulatedWorld(world)
    return [CommState(config, backend=b) for b in sim.backends]


def _step(states: list[CommState], grads: list[torch.Tensor]) -> None:
    futs = [s.reduce(0, g) for s, g in zip(states, grads)]
    for f in futs:
        f.wait()


@pytest.fixture
def checked(monkeypatch) -> list[int]:
    """The sizes of every tensor ``host.finite`` is asked about from now on."""
    sizes: list[int] = []
    original = host.finite

    def counting(*tensors, **kwargs):
        sizes.extend(t.numel() for t in tensors)
        return original(*tensors, **kwargs)

    monkeypatch.setattr(host, "finite", counting)
    return sizes


@pytest.mark.parametrize("method", ["terngrad", "topk"])
def test_the_hook_trusts_the_report_and_discards_a_reported_step(method, checked):
    n = 5000
    states = _states({"method": method})
    g = torch.Generator().manual_seed(3)
    _step(states, [torch.randn(n, generator=g) for _ in states])
    assert n not in checked  # the reduction knew: no pass over the averaged bucket
    for s in states:
        s.end_step()
        assert s.step == 1
    bad = [torch.randn(n, generator=g) for _ in states]
    bad[1][10] = float("inf")
    _step(states, bad)
    for s in states:
        s.end_step()
        assert s.step == 1  # the non-finite step is discarded
    assert n not in checked


def test_the_hook_checks_itself_when_a_part_does_not_know(checked):
    states = _states({"method": "fp16"})
    g = torch.Generator().manual_seed(4)
    _step(states, [torch.randn(777, generator=g) for _ in states])
    assert 777 in checked


@pytest.mark.parametrize("method", ["powersgd", "acpsgd"])
@pytest.mark.parametrize("spoil", [None, "inf", "nan"])
def test_low_rank_reports_the_average_it_checked(method, spoil):
    # PowerSGD and ACP-SGD check every all-reduced factor and dense element on the host:
    # an average built from them is reported finite; a spoiled one is NaN and left to the hook
    g = torch.Generator().manual_seed(5)
    grads = [[torch.randn(32, 16, generator=g), torch.randn(7, generator=g)] for _ in range(2)]
    if spoil is not None:
        grads[1][0][3, 4] = float(spoil)
    sim = SimulatedWorld(2)
    comps = sim.compressors(lambda: build(method, {"rank": 2, "min_compression_rate": 0}))
    for step in range(3):  # ACP-SGD: a P step, a Q step, a P step
        buckets = [Bucket.from_tensors(0, [t.clone() for t in ts], ["w", "b"]) for ts in grads]
        known = sim.reduce(comps, buckets, step=step)
        for c in comps:
            c.end_step(True)
        for b, k in zip(buckets, known):
            truth = bool(torch.isfinite(b.buffer).all())
            assert (k, truth) == ((True, True) if spoil is None else (None, False)), (step, k, truth)
