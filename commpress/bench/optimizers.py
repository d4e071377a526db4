"""The benchmarks' optimizers by name (:data:`commpress.bench.catalog.OPTIMIZERS`): SGD
with momentum, AdamW, and Muon on the hidden matrices beside AdamW on the rest, and the
schedule's learning rate set on each."""

from __future__ import annotations

from typing import Any

import torch

from commpress.optim import HybridOptimizer
from commpress.optim.dion import muon_lr_scale

__all__ = ["Float32Muon", "make_optimizer", "muon_split", "set_lr"]


def make_optimizer(name: str, model: torch.nn.Module, lr: float, rest_lr: float | None = None) -> Any:
    """SGD with momentum 0.9 or AdamW with weight decay 0.01, at ``lr``; ``muon``: a
    :class:`~commpress.optim.HybridOptimizer` of ``torch.optim.Muon`` (on CPU
    :class:`Float32Muon`) at ``lr`` (its step
    scaled to AdamW's RMS, so AdamW's learning rates carry over) on the hidden layers'
    matrices and AdamW at ``rest_lr`` (None: ``lr``) on the rest (:func:`muon_split`),
    both with weight decay 0.01. The AdamW groups then carry ``lr_scale`` (:func:`set_lr`)."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    matrices, rest = muon_split(model)
    kind = torch.optim.Muon if any(p.is_cuda for p in matrices) else Float32Muon
    muon = kind(matrices, lr=lr, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=lr if rest_lr is None else rest_lr, weight_decay=0.01)
    if rest_lr is not None:
        adamw.param_groups[0]["lr_scale"] = rest_lr / lr
    return HybridOptimizer([muon, adamw])


def muon_split(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's, AdamW's) parameters as nanochat and modded-nanogpt split them: Muon steps the
    2-D weights of the hidden layers; AdamW the embeddings, the output head (the model's
    last ``nn.Linear``), norms and biases."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    skip = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    skip |= {id(p) for p in (linears[-1].parameters() if linears else ())}
    matrices = [p for p in model.parameters() if p.ndim == 2 and id(p) not in skip]
    return matrices, [p for p in model.parameters() if p.ndim != 2 or id(p) in skip]


def set_lr(optimizer: Any, lr: float) -> None:
    """Every param group at the schedule's ``lr``, times its ``lr_scale`` where it has one."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr


class Float32Muon(torch.optim.Muon):
    """``torch.optim.Muon``'s step with its Newton-Schulz iteration in float32, for CPUs:
    torch runs the iteration in bfloat16, which a CPU without bfloat16 matrix units
    computes hundreds of times slower (docs/muon.md gives the figure and its command)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = orthogonalized(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * muon_lr_scale(group["adjust_lr_fn"], p.shape))
        return loss


def orthogonalized(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration on ``g`` (float32): about U V^T of its SVD."""
    a, b, c = coefficients
    x = g.float().T if g.size(0) > g.size(1) else g.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x
