"""Low-rank hooks side by side: commpress PowerSGD / ACP-SGD against PyTorch's powerSGD_hook.

A GPT-2-like stack of linear layers (``--blocks`` blocks of width ``--width``: qkv d x 3d,
proj d x d, fc d x 4d, fc2 4d x d, plus LayerNorms and biases; 12 x 416 is 24.9M
parameters) trains on ``--ranks`` local gloo ranks with a batch of ``--batch`` rows, so
each gradient has rank ``--batch`` and the step is dominated by the gradient exchange.
Methods run interleaved in rounds (every method once per round), so a busy machine slows
all of them alike; the table shows median step time, its ratio to PyTorch's hook, and the
time inside commpress compressor code. PyTorch's hook runs with ONE DDP bucket (it fails on
gloo with more), ours with DDP's default buckets.

    PYTHONPATH=. python benchmarks/lowrank_hooks.py --ranks 2 --rank 4 --rounds 5 --steps 8

``--profile`` instead runs the commpress compressors on 2 simulated ranks in one process
(one thread, no network) and prints where their time goes, by torch operation.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from commpress.bench.launch import run_local
from commpress.terminal import format_table

METHODS = ("ddp", "torch-powersgd", "powersgd", "acpsgd")


class Block(nn.Module):
    """The linear layers of a transformer block (attention replaced by its projections)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        d = h.shape[-1]
        h = h + self.proj(self.qkv(self.ln1(h))[:, :d])
        return h + self.fc2(nn.functional.gelu(self.fc(self.ln2(h))))


def make_model(blocks: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(blocks)])


def _ddp_for(method: str, model: nn.Module, rank: int, bucket_cap_mb: float | None = None):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel

    import commpress

    if method == "torch-powersgd":
        size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        ddp = DistributedDataParallel(model, bucket_cap_mb=size_mb + 1)
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, ps.powerSGD_hook)
        return ddp, None
    ddp = DistributedDataParallel(model, **({"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb else {}))
    if method == "ddp":
        return ddp, None
    return ddp, commpress.register(ddp, {"method": method, "start_iter": 2, "params": {"rank": rank}})


def _rank_main(rank_id: int, world: int, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    runs = {}
    for method in args.methods:
        model = make_model(args.blocks, args.width)
        ddp, state = _ddp_for(method, model, args.rank, args.bucket_cap_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        runs[method] = (ddp, state, opt)
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    compute: dict[str, list[float]] = {m: [] for m in args.methods}
    g = torch.Generator().manual_seed(rank_id)
    x = torch.randn(args.batch, args.width, generator=g)

    def step(method: str) -> None:
        ddp, _, opt = runs[method]
        opt.zero_grad(set_to_none=False)
        ddp(x).pow(2).mean().backward()
        opt.step()

    for method in args.methods:  # past start_iter and DDP's bucket rebuild
        for _ in range(4):
            step(method)
    for _ in range(args.rounds):
        for method in args.methods:
            state = runs[method][1]
            for _ in range(args.steps):
                dist.barrier()
                before = state.traffic.snapshot()["compute_seconds"] if state else 0.0
                t0 = time.perf_counter()
                step(method)
                times[method].append(time.perf_counter() - t0)
                if state:
                    compute[method].append(state.traffic.snapshot()["compute_seconds"] - before)
    params = sum(p.numel() for p in runs[args.methods[0]][0].parameters())
    return {"times": times, "compute": compute, "params": params}


def render(results: list[dict], methods: list[str]) -> str:
    # a step counts as its slowest rank
    steps = {m: [max(r["times"][m][i] for r in results) for i in range(len(results[0]["times"][m]))] for m in methods}
    med = {m: statistics.median(v) for m, v in steps.items()}
    ref = med.get("torch-powersgd")
    rows = []
    for m in methods:
        comp = results[0]["compute"][m]
        rows.append(
            [
                m + (" (1 bucket)" if m == "torch-powersgd" else ""),
                f"{1000 * med[m]:.1f}",
                f"{ref / med[m]:.2f}x" if ref else "-",
                f"{1000 * statistics.median(comp):.1f}" if comp else "-",
            ]
        )
    return format_table(["method", "step ms", "speed-up vs torch-powersgd", "compressor ms"], rows)


def profile(args: argparse.Namespace) -> None:
    """Where the commpress compressors spend their time, by torch operation."""
    from commpress.comm import SimulatedWorld
    from commpress.compressors import Bucket, build

    torch.set_num_threads(1)
    model = make_model(args.blocks, args.width)
    params = list(model.parameters())[::-1]  # DDP buckets in reverse order
    names = [f"p{i}" for i in range(len(params))]
    world = 2
    for method in ("powersgd", "acpsgd"):
        sim = SimulatedWorld(world)
        comps = sim.compressors(lambda m=method: build(m, {"rank": args.rank}))

        grads = [[torch.randn_like(p) * 0.01 for p in params] for _ in range(world)]
        buckets = [Bucket.from_tensors(0, g, names) for g in grads]
        saved = [b.buffer.clone() for b in buckets]

        def one_step(step: int, comps=comps, sim=sim, buckets=buckets, saved=saved) -> None:
            for b, s in zip(buckets, saved):
                b.buffer.copy_(s)
            sim.reduce(comps, buckets, step)
            for c in comps:
                c.end_step(True)

        for s in range(3):
            one_step(s)
        prof = cProfile.Profile()
        prof.enable()
        for s in range(args.steps):
            one_step(3 + s)
        prof.disable()
        print(f"\n== {method}, rank {args.rank}, 2 simulated ranks, {args.steps} steps (bucket refill copy_ included) ==")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--width", type=int, default=416)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per method per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket size for ddp and ours (default: DDP's)")
    parser.add_argument("--profile", action="store_true", help="profile the commpress compressors instead")
    args = parser.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.profile:
        profile(args)
        return
    results = run_local(_rank_main, args.ranks, args, timeout=3600)
    print(f"{results[0]['params'] / 1e6:.1f}M parameters, {args.ranks} ranks, rank {args.rank}, batch {args.batch}")
    print(render(results, args.methods))


if __name__ == "__main__":
    main()
