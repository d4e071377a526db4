"""Throughput of the commpress.kernels ops next to a plain copy and to the same op in plain torch.

    python -m commpress.bench.kernels [--device cpu|cuda] [--numel 25165824] [--repeat 7] [--inner 1]

Every op runs on one float32 buffer of ``numel`` elements; GB/s counts that buffer's bytes
(4 * numel) per call, so every row compares with the ``copy`` row (``dst.copy_(src)``).
``of byte limit`` judges an op by the bytes it must move at least (:data:`BYTES`, per
element): its bytes per second over the copy's (8 per element), so 100% is an op as
bound by memory as the copy itself. Rounds are interleaved (each round runs every op
``inner`` times back to back: on a GPU one call of a memory-bound op is shorter than a
launch and a synchronization) and the median is reported, so a change in machine load
affects all rows alike. ``torch ops`` is the same computation written in plain torch
(random numbers from ``torch.rand_like``), the speed-up is its median time over ours.

On CUDA each round is timed twice: by the host clock (``ms``: what a caller waits, launch
costs included) and by CUDA events behind a GPU sleep long enough for the host to queue
every call first (``device ms``: the GPU's own time, no launch gaps; an op that waits for
the host inside, such as Top-k's count, still shows its gaps). The byte limit is judged on
the device time; ``ms`` over ``device ms`` shows what launching costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import commpress.kernels as cc
from commpress.bench.arguments import integer
from commpress.kernels.cpu.openmp import wait_setting

WORLD = 2  # ranks decoded by the accumulate ops
BITS, BUCKET = 4, 1024
DENSITY = 0.01  # top-k keeps 1%
_SPARSE = DENSITY * (4 + 4)  # top-k's values and int32 indices, per element of the tensor

#: Bytes per element an op must read and write at least (float32 tensors, WORLD ranks decoded).
BYTES = {
    "copy": 4 + 4,
    "uniform": 4,
    "pack_bits 2-bit": 1 + 2 / 8,
    "ternary_quantize_pack": 4 + 2 / 8,  # the tensor in, 2-bit codes out
    f"ternary_unpack_accumulate x{WORLD}": WORLD * 2 / 8 + 4,  # every rank's codes in, the sum out
    f"quantize_pack {BITS}-bit B={BUCKET}": 4 + BITS / 8 + 8 / BUCKET,  # codes, min and scale per bucket
    f"unpack_accumulate {BITS}-bit x{WORLD}": WORLD * (BITS / 8 + 8 / BUCKET) + 4,
    f"topk_select {DENSITY:.0%}": 4 + _SPARSE + DENSITY * 4,  # values + indices out, the selection zeroed
    f"topk_select_many {DENSITY:.0%} + error": 4 + 4 + 4 + _SPARSE,  # gradient and residual in, their sum out
    f"scatter_add_decode x{WORLD}": WORLD * _SPARSE + 4,  # every rank's entries in, the dense sum out
    "add_error + update_error": 4 * 3 + 4 * 4,  # acc = grad + error; error = acc - decoded
}


def _torch_ternary(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    keep = (torch.rand_like(x) < x.abs() / scale).to(torch.uint8)
    codes = (keep << (x < 0).to(torch.uint8)).view(-1, 4)
    return codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)


def _torch_ternary_decode(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=packed.device)
    codes = ((packed[:, :, None] >> shifts) & 3).view(packed.shape[0], -1)[:, :n].float()
    values = (codes == 1).float() - (codes == 2).float()
    return (values * scales[:, None]).sum(0) / packed.shape[0]


def _torch_quantize(x: torch.Tensor) -> torch.Tensor:
    xb = x.view(-1, BUCKET)
    lo, hi = xb.amin(1, keepdim=True), xb.amax(1, keepdim=True)
    scale = (hi - lo) / (2**BITS - 1)
    q = torch.floor((xb - lo) / scale + torch.rand_like(xb)).clamp_(0, 2**BITS - 1).to(torch.uint8).view(-1, 2)
    return q[:, 0] | (q[:, 1] << 4)


def _torch_topk(acc: torch.Tensor, k: int) -> torch.Tensor:
    idx = acc.abs().topk(k).indices
    values = acc[idx]
    acc[idx] = 0
    return values


def cases(n: int, device: torch.device) -> dict[str, tuple[Callable[[], object], Callable[[], object] | None]]:
    """name -> (commpress call, plain-torch call or None), all over n float32 elements."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen).to(device)
    dst = torch.empty_like(x)
    scale = x.abs().max()
    k = max(1, int(n * DENSITY))
    tern = torch.stack([cc.ternary_quantize_pack(x, scale, r) for r in range(WORLD)])
    scales = scale.repeat(WORLD)
    q = [cc.quantize_pack(x, BITS, BUCKET, r) for r in range(WORLD)]
    qp, qmins, qscales = (torch.stack(p) for p in zip(*q))
    acc = x.clone()
    summed, error = torch.empty_like(x), x.mul(0.5)
    values, idx = cc.topk_select(x.clone(), k)
    values, idx = values.repeat(WORLD, 1), idx.repeat(WORLD, 1)
    codes = torch.randint(0, 4, (n,), dtype=torch.uint8, generator=gen).to(device)
    out = torch.empty_like(x)
    return {
        "copy": (lambda: dst.copy_(x), None),
        "uniform": (lambda: cc.uniform(1, n, device=device), lambda: torch.rand_like(x)),
        "pack_bits 2-bit": (lambda: cc.pack_bits(codes, 2), None),
        "ternary_quantize_pack": (lambda: cc.ternary_quantize_pack(x, scale, 1), lambda: _torch_ternary(x, scale)),
        f"ternary_unpack_accumulate x{WORLD}": (
            lambda: cc.ternary_unpack_accumulate(tern, scales, n, out),
            lambda: _torch_ternary_decode(tern, scales, n),
        ),
        f"quantize_pack {BITS}-bit B={BUCKET}": (lambda: cc.quantize_pack(x, BITS, BUCKET, 1), lambda: _torch_quantize(x)),
        f"unpack_accumulate {BITS}-bit x{WORLD}": (lambda: cc.unpack_accumulate(qp, qmins, qscales, BITS, BUCKET, n, out), None),
        f"topk_select {DENSITY:.0%}": (lambda: cc.topk_select(acc, k), lambda: _torch_topk(acc, k)),
        f"topk_select_many {DENSITY:.0%} + error": (
            lambda: cc.topk_select_many(summed, [(0, n)], [k], [1], [False], grad=x, error=error),
            None,
        ),
        f"scatter_add_decode x{WORLD}": (lambda: cc.scatter_add_decode(values, idx, n, out), None),
        "add_error + update_error": (lambda: cc.update_error(cc.add_error(x, dst), out, dst), None),
    }


SLEEP_CYCLES_PER_CALL = 2_000_000  # GPU clock cycles (about 1 ms) of sleep per queued call


def _device_seconds(fn: Callable[[], object], inner: int) -> float:
    """Seconds per call on the GPU: ``inner`` calls queued behind a sleep, timed by events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES_PER_CALL * inner)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / inner


def measure(n: int, device: torch.device, repeat: int, inner: int = 1) -> list[dict]:
    """Median seconds of every op and of its torch version, from ``repeat`` interleaved rounds
    of ``inner`` calls each (on CUDA also the device's own seconds)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    calls = cases(n, device)
    times: dict[str, list[float]] = {}
    gpu: dict[str, list[float]] = {}
    for round_ in range(repeat + 1):  # round 0 warms up (kernel compilation, caches)
        for name, (ours, theirs) in calls.items():
            for label, fn in ((name, ours), (name + " [torch]", theirs)):
                if fn is None:
                    continue
                sync()
                start = time.perf_counter()
                for _ in range(inner):
                    fn()
                sync()
                if round_:
                    times.setdefault(label, []).append((time.perf_counter() - start) / inner)
                    if cuda:
                        gpu.setdefault(label, []).append(_device_seconds(fn, inner))
    own = gpu if cuda else times  # what the byte limit is judged on
    copy = statistics.median(own["copy"])
    rows = []
    for name in calls:
        t = statistics.median(times[name])
        d = statistics.median(own[name])
        torch_t = statistics.median(times[name + " [torch]"]) if name + " [torch]" in times else None
        rows.append(
            {
                "op": name,
                "ms": t * 1e3,
                "device ms": d * 1e3 if cuda else None,
                "GB/s": 4 * n / d / 1e9,
                "vs copy": copy / d,
                "bytes/element": BYTES[name],
                "of byte limit": BYTES[name] / BYTES["copy"] * copy / d,
                "torch ops ms": None if torch_t is None else torch_t * 1e3,
                "speed-up": None if torch_t is None else torch_t / t,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    head = "| op | ms | device ms | GB/s | vs copy | of byte limit | torch ops ms | speed-up |"
    lines = [head, "|---|" + "---:|" * 7]
    for r in rows:
        torch_ms = "" if r["torch ops ms"] is None else f"{r['torch ops ms']:.3f}"
        speed = "" if r["speed-up"] is None else f"{r['speed-up']:.1f}x"
        device_ms = "" if r.get("device ms") is None else f"{r['device ms']:.3f}"
        shares = f"{r['vs copy']:.0%} | {r['of byte limit']:.0%}"
        lines.append(f"| {r['op']} | {r['ms']:.3f} | {device_ms} | {r['GB/s']:.2f} | {shares} | {torch_ms} | {speed} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m commpress.bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--numel", type=integer(BUCKET), default=24 << 20, help=f"elements per buffer (a multiple of {BUCKET}; default 24 Mi)"
    )
    parser.add_argument("--repeat", type=integer(1), default=7, help="timed rounds (median reported; default 7)")
    parser.add_argument("--inner", type=integer(1), default=1, help="calls per op per round, back to back (default 1)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.numel % BUCKET:
        parser.error(f"--numel must be a multiple of {BUCKET}")
    device = torch.device(args.device)
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"CPU, {torch.get_num_threads()} torch threads, OpenMP wait: {wait_setting()}"
    rows = measure(args.numel, device, args.repeat, args.inner)
    print(f"{args.numel:,} float32 elements on {where}, median of {args.repeat} interleaved rounds of {args.inner} calls\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "numel": args.numel, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
