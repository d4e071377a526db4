"""Models with the gradient shapes of real networks, for communication benchmarks.

The parameter lists of ResNet-50, BERT-base and GPT-2-small are kept as data
(``commpress/workloads/shapes/*.json``: name and shape of every parameter, in registration
order, so DDP builds the same buckets as for the real model). :class:`ShapedModel` holds
parameters of those shapes and a cheap but real forward/backward: each matrix ``W``
(a weight viewed as ``out x in``) contributes ``sum((W @ V) * U)`` with per-step random
factors ``U`` (out x k) and ``V`` (in x k), so its gradient is ``U @ V.T``, a rank-``k``
matrix that changes every step and differs across ranks, like a real gradient of a
batch; vectors (biases, norms) get a random gradient. The backward costs about
``4 k`` flops per parameter, so communication dominates the step as it does for large
models on slow links.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources

import torch
from torch import nn

from commpress.errors import ConfigError
from commpress.workloads import SHAPE_SETS

__all__ = ["SHAPE_SETS", "ShapedModel", "ShapedTask", "load_shapes", "scale_shapes"]

Shapes = list[tuple[str, tuple[int, ...]]]


@cache
def _read(name: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    if name not in SHAPE_SETS:
        raise ConfigError(f"workload = {name!r} has no shape list; accepted: {', '.join(SHAPE_SETS)}")
    text = resources.files("commpress.workloads").joinpath("shapes", SHAPE_SETS[name]).read_text()
    return tuple((n, tuple(s)) for n, s in json.loads(text)["params"])


def load_shapes(name: str, scale: float = 1.0) -> Shapes:
    """(parameter name, shape) of every parameter of the model ``name``, scaled by ``scale``."""
    return scale_shapes(list(_read(name)), scale)


def scale_shapes(shapes: Shapes, scale: float) -> Shapes:
    """Shrink (or grow) every parameter to about ``scale`` times its elements.

    The leading one or two dimensions (output/input features or channels) are each
    multiplied by ``scale ** (1 / d)`` where ``d`` is how many are scaled, so matrices keep
    their aspect ratio and convolution kernels keep their spatial size. Every dimension
    stays at least 1.
    """
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ConfigError(f"scale = {scale!r} is not accepted; expected a number > 0 (1 = the real model)")
    if scale == 1:
        return list(shapes)
    out = []
    for name, shape in shapes:
        d = min(2, len(shape))
        factor = scale ** (1 / d) if d else 1.0
        out.append((name, tuple(max(1, round(n * factor)) if i < d else n for i, n in enumerate(shape))))
    return out


class ShapedModel(nn.Module):
    """Parameters named and shaped as ``shapes`` (dotted names become submodules), with the
    cheap forward described in the module docstring."""

    def __init__(self, shapes: Shapes, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self._names = []
        for name, shape in shapes:
            owner = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, nn.Parameter(torch.randn(shape, generator=g) * 0.02))
            self._names.append(name)

    def forward(self, factors: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``factors[i]`` is ``(U, V)`` for the i-th parameter (``V`` is empty for vectors)."""
        total = torch.zeros(())
        for name, (u, v) in zip(self._names, factors, strict=True):
            p = self.get_parameter(name)
            term = (p.reshape(p.shape[0], -1) @ v) * u if v.numel() else p * u
            total = total + term.sum()
        return total


@dataclass(frozen=True)
class ShapedTask:
    """A benchmark workload: the model ``name`` at ``scale``, gradients of rank ``k``."""

    name: str = "gpt2"
    scale: float = 0.1
    k: int = 8
    seed: int = 0

    def shapes(self) -> Shapes:
        return load_shapes(self.name, self.scale)

    def model(self) -> ShapedModel:
        """A freshly initialized model, identical on every rank."""
        return ShapedModel(self.shapes(), self.seed)

    def loss(self, model: nn.Module, step: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
        """The step's scalar to backpropagate; factors depend on (seed, step, rank), drawn on
        the CPU (the same numbers on every device) and moved to the model's device."""
        g = torch.Generator().manual_seed(((self.seed * 1_000_003 + step) * 4099 + rank) % (2**63))
        device = next(model.parameters()).device
        factors = []
        for _, shape in self.shapes():
            if len(shape) >= 2:
                rows, cols = shape[0], math.prod(shape[1:])
                u, v = torch.randn(rows, self.k, generator=g), torch.randn(cols, self.k, generator=g)
            else:
                u, v = torch.randn(shape, generator=g), torch.empty(0)
            factors.append((u.to(device), v.to(device)))
        return model(factors)
