"""CPU throughput of the compressors' own work, next to a copy of the same buffer.

    python -m commpress.bench.throughput [--numel 25165824] [--threads 1,2] [--repeat 5]
    python -m commpress.bench.throughput --workload gpt2 --scale 0.05     # real parameter shapes

Each method's ``reduce`` runs on one rank with the collectives answered locally, and its local
work is timed in two phases: *compress* is everything before its last collective, the one
that carries the payload (scales, clipping, selection, packing, framing), *decompress*
everything after it (unframing and decoding ``--world`` ranks' payloads into the bucket). The QSDP rows time the quantizer of
:mod:`commpress.kernels` itself (``quantize_pack``, then ``unpack_accumulate`` of ``--world``
payloads). GB/s counts the float32 gradient (4 bytes per element) per second; ``vs copy``
divides by ``dst.copy_(src)`` of the same buffer, the memory-bandwidth ceiling. Rounds are
interleaved (each round runs every row once, after one untimed warm-up round) and medians
reported, so a change in machine load moves every row alike. Stateful methods (Top-k's
residual) are committed after every run, as in training.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import time
from collections.abc import Callable

import torch

import commpress.kernels as cc
from commpress.bench.arguments import LIST_HELP, integer, listed, method_list, number
from commpress.cmdline import parse_method_spec
from commpress.compressors import AllGather, AllReduce, Bucket, Compressor, Context, build
from commpress.kernels.cpu.openmp import wait_setting
from commpress.terminal import format_table
from commpress.workloads import SHAPE_SETS

__all__ = ["DEFAULT_METHODS", "DEFAULT_NUMEL", "equal_sizes", "measure", "table", "workload_sizes"]

DEFAULT_METHODS = ("terngrad", "topk:ratio=0.01", "topk:ratio=0.01,selection=exact", "fp16", "bf16")
DEFAULT_QSDP = ((8, 1024), (4, 1024))  # (bits, bucket size); 8-bit, 1024 is the [fsdp] default
DEFAULT_NUMEL = 1 << 22  # quick; --numel 25165824 (24 Mi) for the figures in the docs

Run = Callable[[int], tuple[float, float]]  # step -> (compress seconds, decompress seconds)


def equal_sizes(numel: int, tensors: int) -> list[int]:
    """``tensors`` parameter sizes adding up to ``numel``, as equal as possible."""
    return [numel // tensors + (1 if i < numel % tensors else 0) for i in range(tensors)]


def workload_sizes(name: str, scale: float) -> list[int]:
    """The parameter sizes of a ``commpress bench`` workload, in DDP's bucket order (last layer first)."""
    from commpress.bench.workloads import make_workload

    return [p.numel() for p in reversed(list(make_workload(name, scale).model().parameters()))]


def _buckets(sizes: list[int], cap_bytes: int) -> list[list[tuple[str, int, int]]]:
    """Parameters of ``sizes`` as ``(name, offset, numel)``, grouped in order into buckets of at
    most ``cap_bytes`` float32 bytes (a larger parameter gets a bucket of its own)."""
    buckets: list[list[tuple[str, int, int]]] = [[]]
    offset = filled = 0
    for i, size in enumerate(sizes):
        if buckets[-1] and filled + 4 * size > cap_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append((f"t{i}", offset, size))
        offset += size
        filled += 4 * size
    return buckets


def _reduce_timed(comp: Compressor, bucket: Bucket, ctx: Context) -> tuple[float, float]:
    """One ``reduce`` with the collectives answered locally: seconds of local work before its
    last collective (the one carrying the payload) and after it."""
    gen = comp.reduce(bucket, ctx)
    segments, result = [], None  # local work between collectives
    start = time.perf_counter()
    while True:
        try:
            request = gen.send(result)
        except StopIteration:
            segments.append(time.perf_counter() - start)
            return sum(segments[:-1]), segments[-1]
        segments.append(time.perf_counter() - start)
        if isinstance(request, AllGather):  # every rank sent what this one did
            result = [request.tensor.clone() for _ in range(ctx.world_size)]
        elif isinstance(request, AllReduce):  # a sum or max of identical ranks, taken as one rank's
            result = request.tensor.clone()
        else:
            raise TypeError(f"{comp.name} yielded {type(request).__name__}; this tool answers AllGather and AllReduce")
        start = time.perf_counter()


def _compressor_run(comp: Compressor, grad: torch.Tensor, layout: list[list[tuple[str, int, int]]], world: int) -> Run:
    """One step: every bucket of ``layout`` reduced, then the step's state committed. The bucket
    buffers persist across steps and are refilled from ``grad`` (untimed), as DDP's are."""
    buckets = []
    for index, params in enumerate(layout):
        names = [name for name, _, _ in params]
        buckets.append(Bucket.from_tensors(index, [grad.narrow(0, offset, size) for _, offset, size in params], names))

    def run(step: int) -> tuple[float, float]:
        compress = decompress = 0.0
        for bucket, params in zip(buckets, layout):
            first, last = params[0], params[-1]
            bucket.buffer.copy_(grad.narrow(0, first[1], last[1] + last[2] - first[1]))
            c, d = _reduce_timed(comp, bucket, Context(rank=0, world_size=world, step=step))
            compress += c
            decompress += d
        comp.end_step(True)
        return compress, decompress

    return run


def _qsdp_run(x: torch.Tensor, bits: int, bucket: int, world: int) -> Run:
    out = torch.empty_like(x)

    def run(step: int) -> tuple[float, float]:
        start = time.perf_counter()
        payload = cc.quantize_pack(x, bits, bucket, step)
        compress = time.perf_counter() - start
        gathered = [t.unsqueeze(0).expand(world, -1).contiguous() for t in payload]  # every rank sent the same
        start = time.perf_counter()
        cc.unpack_accumulate(*gathered, bits, bucket, x.numel(), out)
        return compress, time.perf_counter() - start

    return run


def _runs(sizes: list[int], world: int, bucket_mb: float, methods: list[str], qsdp: list[tuple[int, int]]) -> dict[str, Run]:
    grad = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0))
    layout = _buckets(sizes, int(bucket_mb * 2**20))
    runs: dict[str, Run] = {}
    for spec in methods:
        parsed = parse_method_spec(spec)
        runs[spec] = _compressor_run(build(parsed["method"], parsed["params"]), grad, layout, world)
    for bits, bucket in qsdp:
        runs[f"qsdp {bits}-bit B={bucket}"] = _qsdp_run(grad, bits, bucket, world)
    dst = torch.empty_like(grad)

    def copy(step: int) -> tuple[float, float]:
        start = time.perf_counter()
        dst.copy_(grad)
        spent = time.perf_counter() - start
        return spent, spent

    return {"copy_": copy, **runs}


def measure(
    sizes: list[int],
    threads: list[int],
    repeat: int,
    world: int = 2,
    bucket_mb: float = 25.0,
    methods: list[str] | None = None,
    qsdp: list[tuple[int, int]] | None = None,
) -> list[dict]:
    """One row per (thread count, method): compress and decompress GB/s and their ratio to copy_,
    for a gradient of parameters of ``sizes`` elements."""
    methods = list(DEFAULT_METHODS if methods is None else methods)
    qsdp = list(DEFAULT_QSDP if qsdp is None else qsdp)
    before = torch.get_num_threads()
    rows = []
    try:
        for count in threads:
            torch.set_num_threads(count)
            runs = _runs(sizes, world, bucket_mb, methods, qsdp)
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
            for round_ in range(repeat + 1):  # round 0 warms up (compilation, allocations, residuals)
                for name, run in runs.items():
                    spent = run(round_)
                    if round_:
                        times[name].append(spent)
            gb = 4 * sum(sizes) / 1e9
            copy = gb / statistics.median(t[0] for t in times["copy_"])
            for name, spent in times.items():
                c = gb / statistics.median(t[0] for t in spent)
                d = gb / statistics.median(t[1] for t in spent)
                rows.append({"method": name, "threads": count, "compress": c, "decompress": d, "copy": copy})
    finally:
        torch.set_num_threads(before)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a text table, GB/s and the fraction of copy_."""
    cells = [
        [
            r["method"],
            r["threads"],
            f"{r['compress']:.2f}",
            f"{r['compress'] / r['copy']:.0%}",
            f"{r['decompress']:.2f}",
            f"{r['decompress'] / r['copy']:.0%}",
        ]
        for r in rows
    ]
    return format_table(["method", "threads", "compress GB/s", "vs copy", "decompress GB/s", "vs copy"], cells)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m commpress.bench.throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=integer(1), default=DEFAULT_NUMEL, help=f"gradient elements (default {DEFAULT_NUMEL:,})")
    parser.add_argument("--tensors", type=integer(1), default=4, help="parameters of equal size (default 4)")
    parser.add_argument(
        "--workload",
        choices=tuple(SHAPE_SETS),
        help="the parameter shapes of this workload instead of --numel/--tensors",
    )
    parser.add_argument(
        "--scale", type=number(0, 1), default=0.1, help="with --workload: fraction of its parameters, in (0, 1] (default 0.1)"
    )
    parser.add_argument(
        "--threads", type=listed(integer(1)), default=[1, 2], help="torch thread counts, comma-separated (default 1,2)"
    )
    parser.add_argument("--repeat", type=integer(1), default=5, help="timed rounds, median reported (default 5)")
    parser.add_argument("--world", type=integer(1), default=2, help="ranks whose payloads are decoded (default 2)")
    parser.add_argument(
        "--bucket-mb",
        type=number(0),
        default=25.0,
        help="parameters per bucket up to this many MiB, as DDP's bucket_cap_mb (default 25)",
    )
    parser.add_argument(
        "--methods",
        type=method_list(),
        default=list(DEFAULT_METHODS),
        help=f"{LIST_HELP} (default: {';'.join(DEFAULT_METHODS)})",
    )
    args = parser.parse_args(argv)
    sizes = workload_sizes(args.workload, args.scale) if args.workload else equal_sizes(args.numel, args.tensors)
    methods = args.methods
    backend = f"numba {importlib.metadata.version('numba')}"  # the CPU kernels are compiled by numba
    buckets = len(_buckets(sizes, int(args.bucket_mb * 2**20)))
    what = f"workload {args.workload} at scale {args.scale}: " if args.workload else ""
    print(
        f"CPU backend: {backend}. {what}{sum(sizes):,} float32 elements in {len(sizes)} tensors, {buckets} "
        f"bucket{'s' * (buckets != 1)}; decode of {args.world} ranks; median of {args.repeat} interleaved rounds; "
        f"OpenMP wait: {wait_setting()}\n"
    )
    print(table(measure(sizes, args.threads, args.repeat, args.world, args.bucket_mb, methods)))


if __name__ == "__main__":
    main()
