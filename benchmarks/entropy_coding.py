"""The wire's entropy coder beside deflate's Huffman stage, on TernGrad's codes.

    python benchmarks/entropy_coding.py [--rounds 9] [--threads 1]

TernGrad's 2-bit codes of the race transformer's 3.24M parameters (Gaussian values, its
tensor sizes, clipped at 2.5 sigma as TernGrad does) coded and decoded by
``commpress.kernels.huffman`` (what ``entropy = true`` sends) and by Python's zlib with
Huffman coding alone (``Z_HUFFMAN_ONLY``, raw deflate: what it sent before 2026-11-29),
interleaved round by round; the median of each, one core unless ``--threads``. Then
TernGrad's whole reduction per rank, with and without the coding, on a simulated world of
2 and 3 ranks: what one DiLoCo sync of that model costs a rank's processor.
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib

import torch

from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build
from commpress.kernels import huffman_decode, huffman_encode, ternary_quantize_pack
from commpress.workloads.synthetic import CharTransformerTask

# the race transformer's tensors (its defaults: width 256, 4 layers, 4 heads, context 64)
SIZES = [p.numel() for p in CharTransformerTask(context=64, width=256, layers=4, heads=4).model().parameters()]


def codes(seed: int) -> torch.Tensor:
    """TernGrad's codes of every tensor of SIZES, concatenated (uint8, 4 codes a byte)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(SIZES):
        x = torch.randn(n, generator=g)
        bound = (2.5 * x.square().mean().sqrt()).reshape(1)
        out.append(ternary_quantize_pack(x, bound.reshape(()), seed * 1000 + i, bound=bound))
    return torch.cat(out)


def _deflate(raw: bytes) -> bytes:
    coder = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return coder.compress(raw) + coder.flush()


def coders(rounds: int) -> list[tuple[str, float, float, int]]:
    """(coder, encode ms, decode ms, coded bytes) medians over ``rounds`` payloads."""
    runs: dict[str, list[tuple[float, float, int]]] = {"huffman (commpress.kernels)": [], "zlib Z_HUFFMAN_ONLY": []}
    for r in range(rounds + 1):  # round 0 compiles and warms up
        payload = codes(r)
        raw = payload.numpy().tobytes()
        t0 = time.perf_counter()
        frame = huffman_encode(payload)
        t1 = time.perf_counter()
        back = huffman_decode(frame, payload.numel())
        t2 = time.perf_counter()
        deflated = _deflate(raw)
        t3 = time.perf_counter()
        inflated = zlib.decompress(deflated, -15, len(raw))
        t4 = time.perf_counter()
        if not (torch.equal(back, payload) and inflated == raw):
            raise RuntimeError("a coder did not give back its payload")
        if r:
            runs["huffman (commpress.kernels)"].append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, frame.numel()))
            runs["zlib Z_HUFFMAN_ONLY"].append(((t3 - t2) * 1e3, (t4 - t3) * 1e3, len(deflated)))
    return [(name, *(statistics.median(col) for col in zip(*rows))) for name, rows in runs.items()]  # type: ignore[misc]


def reduction_ms(world: int, entropy: bool, rounds: int) -> float:
    """Median milliseconds per rank of TernGrad's reduction of SIZES on ``world`` ranks."""
    times = []
    names = [f"t{i}" for i in range(len(SIZES))]
    for step in range(rounds + 1):
        g = torch.Generator().manual_seed(step)
        buckets = [Bucket.from_tensors(0, [torch.randn(n, generator=g) for n in SIZES], names) for _ in range(world)]
        sim = SimulatedWorld(world)
        comps = sim.compressors(lambda: build("terngrad", {"entropy": entropy}))
        t0 = time.perf_counter()
        sim.reduce(comps, buckets, step=step)
        if step:
            times.append((time.perf_counter() - t0) / world * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = sum(SIZES)
    print(f"{n:,} values, {(n + 3) // 4:,} bytes of codes, {args.threads} thread(s), medians of {args.rounds}")
    print("| coder | encode ms | decode ms | coded bytes | bits a value |\n|---|---:|---:|---:|---:|")
    for name, enc, dec, size in coders(args.rounds):
        print(f"| {name} | {enc:.2f} | {dec:.2f} | {size:,.0f} | {8 * size / n:.3f} |")
    print("\n| TernGrad's reduction, ms per rank | plain codes | entropy-coded |\n|---|---:|---:|")
    for world in (2, 3):
        plain, coded = (reduction_ms(world, e, args.rounds) for e in (False, True))
        print(f"| world of {world} | {plain:.1f} | {coded:.1f} |")


if __name__ == "__main__":
    main()
