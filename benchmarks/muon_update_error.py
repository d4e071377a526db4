"""Why a method costs more under Muon than under AdamW, or less: the step each optimizer
takes from the method's average of the gradients, against the step from the exact average.

The race's transformer (3.24M parameters, seed 0) is first trained WARM steps with DDP +
Muon's split (exact averages), then held fixed: for STEPS batches, 2 simulated ranks
compute their gradients, the exact average and each ready config's average (its method
and params, its error feedback carried from batch to batch, over the hidden matrices Muon
steps) feed one Muon momentum (0.95, Nesterov, Newton-Schulz) and one AdamW moment pair
(0.9, 0.999) each. Printed per method, averaged over the last half of the batches: the
relative error of the averaged gradient, of Muon's update and of AdamW's update, each
``|u(method) - u(exact)| / |u(exact)|`` over all the hidden matrices.

    python benchmarks/muon_update_error.py [--warm 100] [--steps 40]

docs/choosing.md ("Under Muon") quotes the output.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from commpress.bench.optimizers import make_optimizer, muon_split, orthogonalized, set_lr
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build
from commpress.config import Config
from commpress.workloads.synthetic import CharTransformerTask

CONFIGS = ("bf16", "quant", "powersgd", "acpsgd", "terngrad", "onebit", "topk")
ROOT = Path(__file__).resolve().parents[1]
NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)  # torch.optim.Muon's defaults
MU, BETAS, EPS = 0.95, (0.9, 0.999), 1e-8


def gradients(task: CharTransformerTask, model: torch.nn.Module, step: int, matrices: list) -> list[list[torch.Tensor]]:
    """Each of 2 ranks' gradients of the hidden matrices on its batch of ``step``."""
    out = []
    for rank in range(2):
        model.zero_grad()
        x, y = task.batch(step, rank, 2)
        task.loss(model(x), y).backward()
        out.append([p.grad.detach().clone() for p in matrices])
    return out


class Steps:
    """Muon's and AdamW's update directions from a sequence of averaged gradients."""

    def __init__(self, shapes: list[torch.Size]) -> None:
        self.muon = [torch.zeros(s) for s in shapes]
        self.m = [torch.zeros(s) for s in shapes]
        self.v = [torch.zeros(s) for s in shapes]
        self.t = 0

    def __call__(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        self.t += 1
        muon, adamw = [], []
        for g, buf, m, v in zip(grads, self.muon, self.m, self.v):
            buf.lerp_(g, 1 - MU)
            muon.append(orthogonalized(g.lerp(buf, MU), *NS).reshape(-1))
            m.lerp_(g, 1 - BETAS[0])
            v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            m_hat, v_hat = m / (1 - BETAS[0] ** self.t), v / (1 - BETAS[1] ** self.t)
            adamw.append((m_hat / (v_hat.sqrt() + EPS)).reshape(-1))
        return torch.cat(muon), torch.cat(adamw)


def _error(a: torch.Tensor, exact: torch.Tensor) -> float:
    return float((a - exact).norm() / exact.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", type=int, default=100, help="DDP + Muon steps before the weights are held")
    parser.add_argument("--steps", type=int, default=40, help="batches at the held weights")
    args = parser.parse_args()
    torch.manual_seed(0)
    task = CharTransformerTask(64, 16, 0, 256, 4, 4)
    model = task.model()
    opt = make_optimizer("muon", model, 8e-3, rest_lr=1e-3)
    for step in range(args.warm):
        set_lr(opt, 8e-3 * min(1.0, (step + 1) / 20))
        opt.zero_grad()
        for rank in range(2):
            x, y = task.batch(step, rank, 2)
            (task.loss(model(x), y) / 2).backward()
        opt.step()
    matrices, _ = muon_split(model)
    names = [n for n, p in model.named_parameters() if any(p is m for m in matrices)]
    shapes = [p.shape for p in matrices]
    world = SimulatedWorld(2)
    methods = {}
    for name in CONFIGS:
        cfg = Config.load(ROOT / "docs" / "configs" / f"{name}.toml")
        methods[name] = world.compressors(lambda cfg=cfg: build(cfg.method, dict(cfg.params)))
    exact_steps = Steps(shapes)
    steps = {name: Steps(shapes) for name in CONFIGS}
    errors: dict[str, list[tuple[float, float, float]]] = {name: [] for name in CONFIGS}
    for t in range(args.steps):
        ranks = gradients(task, model, args.warm + t, matrices)
        exact = [(a + b) / 2 for a, b in zip(*ranks)]
        exact_muon, exact_adamw = exact_steps(exact)
        for name, comps in methods.items():
            buckets = [Bucket.from_tensors(0, grads, names) for grads in ranks]
            finite = world.reduce(comps, buckets, step=t)
            assert all(f is not False for f in finite), (name, finite)
            for c in comps:
                c.end_step(True)
            averaged = buckets[0].views()
            muon, adamw = steps[name](averaged)
            grad_error = _error(torch.cat([g.reshape(-1) for g in averaged]), torch.cat([g.reshape(-1) for g in exact]))
            errors[name].append((grad_error, _error(muon, exact_muon), _error(adamw, exact_adamw)))
    print(f"warm {args.warm} steps, {args.steps} batches held; mean over the last {args.steps // 2}")
    print("| config | averaged gradient's error | Muon update's error | AdamW update's error |")
    print("|---|---|---|---|")
    for name, rows in errors.items():
        late = rows[args.steps // 2 :]
        mean = [sum(r[i] for r in late) / len(late) for i in range(3)]
        print(f"| {name}.toml | {mean[0]:.3f} | {mean[1]:.3f} | {mean[2]:.3f} |")


if __name__ == "__main__":
    main()
