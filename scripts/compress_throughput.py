"""CPU throughput of compress and decompress, against a plain copy of the same buffer.

Runs each compressor's own ``reduce`` generator on one rank and times its local work:
*compress* is everything before the all-gather (scales, clipping, selection, packing,
framing), *decompress* everything after it (unframing and decoding ``--world`` ranks'
payloads into the bucket). Throughput is gradient bytes (float32) processed per second;
the ``copy`` row, ``dst.copy_(src)`` of the same buffer, is the memory-bandwidth ceiling,
measured in the same run. Medians over ``--repeat`` runs.

    PYTHONPATH=. python scripts/compress_throughput.py --numel 25000000 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from commpress.terminal import format_table
from commpress.compressors import AllGather, AllReduce, Bucket, Compressor, Context, build

DEFAULT_METHODS = "terngrad;topk:ratio=0.01;topk:ratio=0.01,selection=exact;topk:ratio=0.01,value_dtype=float16"


def _median_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: allocator, lazy imports
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _phases(comp: Compressor, grad: torch.Tensor, sizes: list[int], world: int) -> tuple[float, float]:
    """(compress seconds, decompress seconds) of one reduce on rank 0 of ``world``."""
    bucket = Bucket.from_tensors(0, list(grad.split(sizes)), [f"t{i}" for i in range(len(sizes))])
    compress = decompress = 0.0
    gen = comp.reduce(bucket, Context(rank=0, world_size=world, step=0))
    t0 = time.perf_counter()
    request = next(gen)
    while True:
        now = time.perf_counter()
        if isinstance(request, AllGather):
            compress += now - t0
            result: object = [request.tensor.clone() for _ in range(world)]  # every rank sent the same
            t0 = time.perf_counter()
            try:
                gen.send(result)
            except StopIteration:
                decompress += time.perf_counter() - t0
                return compress, decompress
            raise RuntimeError(f"{comp.name} yielded after its all-gather")
        assert isinstance(request, AllReduce)
        compress += now - t0
        result = request.tensor  # one rank's max/sum is itself
        t0 = time.perf_counter()
        request = gen.send(result)


def measure(numel: int, tensors: int, world: int, repeat: int, specs: list[str]) -> list[list[str]]:
    """Table rows: method, compress GB/s, decompress GB/s, each also as a fraction of copy."""
    from commpress.config import parse_method_spec

    g = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=g)
    sizes = [numel // tensors + (1 if i < numel % tensors else 0) for i in range(tensors)]
    dst = torch.empty_like(grad)
    gb = numel * 4 / 1e9
    copy = gb / _median_seconds(lambda: dst.copy_(grad), repeat)
    rows = [["copy", f"{copy:.2f}", "1.00x", f"{copy:.2f}", "1.00x"]]
    for spec in specs:
        parsed = parse_method_spec(spec)
        comp = build(parsed["method"], parsed["params"])  # reused: steady state, residuals allocated
        runs = [_phases(comp, grad, sizes, world) for _ in range(repeat + 1)][1:]
        c = gb / statistics.median(r[0] for r in runs)
        d = gb / statistics.median(r[1] for r in runs)
        rows.append([spec, f"{c:.3g}", f"{c / copy:.3g}x", f"{d:.3g}", f"{d / copy:.3g}x"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000, help="gradient elements (float32), default 25M")
    parser.add_argument("--tensors", type=int, default=4, help="parameters the bucket holds, equal sizes (default 4)")
    parser.add_argument("--world", type=int, default=2, help="ranks whose payloads are decoded (default 2)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per row, median reported (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"';'-separated method specs (default {DEFAULT_METHODS!r})")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [s.strip() for s in args.methods.split(";") if s.strip()]
    rows = measure(args.numel, args.tensors, args.world, args.repeat, specs)
    print(
        f"{args.numel:,} float32 elements in {args.tensors} tensors, decode of {args.world} ranks, "
        f"{torch.get_num_threads()} threads, median of {args.repeat}"
    )
    print(format_table(["method", "compress GB/s", "vs copy", "decompress GB/s", "vs copy"], rows))


if __name__ == "__main__":
    main()
