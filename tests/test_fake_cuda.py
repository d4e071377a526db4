"""Every compressor on CUDA gradients, checked on a machine without a GPU.

Under torch's ``FakeTensorMode`` tensors carry shape, dtype and device but no data:
``torch.empty(4, device="cuda")`` is a fake CUDA tensor even on a CPU-only build, and any
operation that mixes it with a CPU tensor raises ``FakeTensorDeviceMismatchError``. Running
whole steps of a compressor on fake CUDA buckets therefore finds every buffer it makes on
the wrong device: error and spare buffers, payloads, random and second factors, the plan's
index tensors, residuals, frames, and state restored from a checkpoint.

Covered, for every registered compressor (``available()``), float32 and the half dtypes:
several steps on two ranks (fresh state, warm starts, ACP-SGD's alternation), a
checkpoint saved (its tensors must be on the CPU) and loaded into new compressors that
continue on CUDA (restored through ``host.to_device`` once, then kept on the device), and
a bucket split into two method groups the way ``CommState`` runs overrides. Every
collective a compressor yields must hold CUDA tensors.

On a CPU-only build, some Python bindings of tensor methods need the CUDA runtime even for
fake tensors (indexing, ``Tensor.copy_``, ``contiguous()`` of a strided tensor): the
compressors use ``narrow``/``index_select`` instead of indexing, and ``Tensor.copy_`` is
routed here to the ATen operator, refusing copies between devices (a transfer must go
through the host seams).

Not covered: numbers (fake tensors hold none; the CPU tests check values). The host reads
go through :mod:`commpress.compressors.host`, patched here (flags read as all true, a
restored tensor becomes an empty one on the device). TernGrad and Top-k run their CUDA
kernels through CuPy: here ``commpress.kernels.cuda._launch.launch`` is replaced by a recorder, so
the tests check that every kernel front-end is reached with CUDA tensors and that no CPU
kernel runs (``_chunks.map_blocks`` raises), not the kernels themselves. Top-k's selection
also reads data on the host (the sampled threshold): ``topk_select`` is replaced by a
stand-in that checks its arguments and calls the CUDA compaction of ``_launch`` directly,
so that data-dependent part is not run. The decode reads nothing back: it runs as it is.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from commpress.compressors import AllGather, AllReduce, Bucket, Context, available, build, host
from commpress.kernels.cpu import _chunks
from commpress.kernels.cuda import _launch

CUDA = torch.device("cuda", 0)
SHAPES = [(12, 10), (12,), (12, 10), (8, 3, 2, 2), (12, 10), (3,), (2, 2), (20, 6)]
NAMES = [f"t{i}" for i in range(len(SHAPES))]
PARAMS = {
    "powersgd": [{"rank": 2}, {"rank": 2, "warm_start": False}],
    "acpsgd": [{"rank": 2}, {"rank": 2, "warm_start": False}],
    # min_numel 0: these small tensors would otherwise travel whole, with no Top-k state
    "topk": [
        {"ratio": 0.1, "min_numel": 0},
        {"ratio": 0.1, "value_dtype": "float16", "min_numel": 0},
        {"ratio": 0.1, "value_bits": 2, "min_numel": 0},
    ],
    "terngrad": [{}],
    "quant": [
        {"bits": 4, "min_numel": 0, "bucket_size": 16},
        {"bits": 2, "error_feedback": True, "min_numel": 40, "bucket_size": 8},
    ],
    "onebit": [{"min_numel": 0}, {"min_numel": 100}, {"min_numel": 0, "error_feedback": False}],
}
CASES = [(m, p) for m in available() if not m.startswith("test-") for p in PARAMS.get(m, [{}])]


@pytest.fixture
def fake_cuda(monkeypatch):
    """Fake mode, with the host seams and the CuPy launcher patched; yields the records."""
    seen = {"launches": [], "restored": 0}

    def launch(module, function, device, work, args, block=256, grid=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        assert device.type == "cuda" and all(t.device == device for t in tensors), (function, [t.device for t in tensors])
        seen["launches"].append(function)

    def to_device(t, device):
        assert t.device.type == "cpu" and device == CUDA
        seen["restored"] += 1
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    def no_cpu_path(*args, **kwargs):
        raise AssertionError("a CUDA tensor took a CPU kernel of commpress.kernels")

    def copy_(self, src, non_blocking=False):
        assert self.device == src.device, f"copy_ from {src.device} to {self.device} outside commpress.compressors.host"
        return torch.ops.aten.copy_.default(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(_launch, "launch", launch)
    monkeypatch.setattr(host, "flags", lambda t: [True] * t.numel())
    monkeypatch.setattr(host, "to_device", to_device)
    monkeypatch.setattr(_chunks, "map_blocks", no_cpu_path)
    monkeypatch.setattr("commpress.kernels.topk.topk_select", _topk_select)
    with FakeTensorMode():
        yield seen


def _topk_select(acc, k, exact=False, sample=None, seed=0):
    """Stand-in of commpress.kernels.topk_select: the first k entries, through the CUDA front-end."""
    assert acc.device == CUDA and acc.is_contiguous()
    return _launch.gather_and_zero(acc.view(-1), torch.arange(k, device=acc.device))


def _drive(comps, buckets, step: int) -> None:
    """Step one reduction per rank in lockstep, answering collectives exactly (sum, max, gather)."""
    world = len(comps)
    gens = [c.reduce(b, Context(rank=r, world_size=world, step=step)) for r, (c, b) in enumerate(zip(comps, buckets))]
    results = [None] * world
    while True:
        requests = []
        for gen, result in zip(gens, results):
            try:
                requests.append(gen.send(result))
            except StopIteration:
                requests.append(None)
        if all(r is None for r in requests):
            return
        assert None not in requests and len({type(r) for r in requests}) == 1
        assert all(r.tensor.device == CUDA for r in requests), [r.tensor.device for r in requests]
        if isinstance(requests[0], AllReduce):
            total = requests[0].tensor.clone()
            for r in requests[1:]:
                total = total + r.tensor if r.op == "sum" else torch.maximum(total, r.tensor)
            for r in requests:
                r.tensor.copy_(total)
            results = [r.tensor for r in requests]
        else:
            assert isinstance(requests[0], AllGather)
            gathered = [r.tensor.reshape(-1).clone() for r in requests]
            results = [[g.clone() for g in gathered] for _ in requests]


def _buckets(world: int, dtype: torch.dtype, names=NAMES, shapes=SHAPES, index: int = 0) -> list[Bucket]:
    return [Bucket.from_tensors(index, [torch.randn(s, device=CUDA).to(dtype) for s in shapes], names) for _ in range(world)]


def _check_state_on_cpu(state) -> None:
    if isinstance(state, torch.Tensor):
        assert state.device.type == "cpu"
    elif isinstance(state, dict):
        for value in state.values():
            _check_state_on_cpu(value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("method", "params"), CASES)
def test_steps_and_resume_stay_on_the_device(fake_cuda, method, params, dtype):
    world = 2
    comps = [build(method, params) for _ in range(world)]
    for step in range(4):
        bs = _buckets(world, dtype)
        _drive(comps, bs, step)
        assert all(b.buffer.device == CUDA and b.buffer.dtype == dtype for b in bs)
        for c in comps:
            c.end_step(step != 2)  # one discarded step
    # DDP's rebuilt layout: the same parameters in two buckets, in another order
    for index, names in enumerate([NAMES[4:][::-1], NAMES[:4]]):
        shapes = [SHAPES[NAMES.index(n)] for n in names]
        _drive(comps, _buckets(world, dtype, names, shapes, index), 4)
    for c in comps:
        c.end_step(True)
    saved = [c.state_dict() for c in comps]
    _check_state_on_cpu(saved)
    stateful = method in ("powersgd", "acpsgd", "topk") or params.get("error_feedback", method == "onebit")
    assert bool(saved[0]) == stateful
    resumed = [build(method, params) for _ in range(world)]
    for c, s in zip(resumed, saved):
        c.load_state_dict(s)
    for step in range(5, 8):
        _drive(resumed, _buckets(world, dtype), step)
        for c in resumed:
            c.end_step(True)
        if step == 5:
            restored = fake_cuda["restored"]
            assert (restored > 0) == stateful  # saved tensors went back to the device once
    assert fake_cuda["restored"] == restored  # ... and stayed there
    if method in ("topk", "terngrad", "onebit"):  # their kernels were reached with CUDA tensors
        assert fake_cuda["launches"], method


@pytest.mark.parametrize(("small", "large"), [("topk", "powersgd"), ("terngrad", "acpsgd"), ("fp16", "topk")])
def test_two_method_groups_of_one_bucket(fake_cuda, small, large):
    """As CommState runs overrides: each group's parameters gathered into their own bucket,
    reduced by their own compressor, and scattered back."""
    world = 2
    groups = {
        "small": [n for n, s in zip(NAMES, SHAPES) if len(s) == 1],
        "large": [n for n, s in zip(NAMES, SHAPES) if len(s) > 1],
    }
    comps = {"small": [build(small) for _ in range(world)], "large": [build(large) for _ in range(world)]}
    for step in range(3):
        full = _buckets(world, torch.float32)
        for key, names in groups.items():
            slots = [s for s in full[0].slots if s.name in names]
            parts = [
                Bucket.from_tensors(0, [b.buffer.narrow(0, s.offset, s.numel).view(s.shape) for s in slots], names) for b in full
            ]
            _drive(comps[key], parts, step)
            for b, part in zip(full, parts):
                for s, view in zip(slots, part.views()):
                    b.buffer.narrow(0, s.offset, s.numel).copy_(view.reshape(-1))
        for group in comps.values():
            for c in group:
                c.end_step(True)
        assert all(b.buffer.device == CUDA for b in full)


def test_entropy_coded_terngrad_gathers_on_the_device(fake_cuda, monkeypatch):
    """Both collectives of the entropy coder (the coded sizes' maximum, then the frames)
    carry CUDA tensors: an NCCL-only group takes no other. The coding itself is a host
    operation on data, which fake tensors do not hold: Huffman coding, the frames' decode
    and the own-frame comparison are stand-ins here that check where their tensors are."""
    from commpress.compressors.wire import entropy

    def encode(payload):
        assert payload.device == CUDA and payload.dtype == torch.uint8
        return torch.empty(payload.numel() // 2, dtype=torch.uint8)  # coded on the host

    def decoded(frame, size):
        assert frame.device.type == "cpu"
        return torch.empty(size, dtype=torch.uint8)

    monkeypatch.setattr(entropy, "huffman_encode", encode)
    monkeypatch.setattr(entropy, "_decoded", decoded)
    monkeypatch.setattr(host, "numbers", lambda t: [float(1 << 12)] * t.numel())  # the longest coded frame
    monkeypatch.setattr(torch, "equal", lambda a, b: False)  # every frame decoded
    comps = [build("terngrad", {"entropy": True}) for _ in range(2)]
    for step in range(2):
        buckets = _buckets(2, torch.float32)
        _drive(comps, buckets, step)  # refuses any collective off the device
        assert all(b.buffer.device == CUDA for b in buckets)
        for c in comps:
            c.end_step(True)
    assert fake_cuda["launches"]


def test_a_cpu_buffer_would_be_caught(fake_cuda):
    """The check itself: a CUDA bucket meeting a CPU error buffer fails under fake mode."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    bucket = _buckets(1, torch.float32)[0]
    with pytest.raises(FakeTensorDeviceMismatchError):
        bucket.buffer + torch.zeros(bucket.buffer.numel())
