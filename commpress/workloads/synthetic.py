"""Two more small training tasks for the quality suite, unlike the demo's character MLP in
shape: a convolutional net on generated images, and a tiny causal transformer on the
demo's text. Both are seeded and need no downloads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from commpress.workloads.charlm import VOCAB, corpus

__all__ = ["CharTransformer", "CharTransformerTask", "ShapesNet", "ShapesTask"]

_SIZE = 16  # image side
_CLASSES = 6  # horizontal, vertical, diagonal, anti-diagonal stripes, checkerboard, rings


def _seed(seed: int, step: int, rank: int) -> int:
    return ((seed * 1_000_003 + step) * 4099 + rank) % (2**63)


def shapes_batch(n: int, generator: torch.Generator, size: int = _SIZE, noise: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` ``size`` x ``size`` images of one of six periodic patterns (random period, phase,
    contrast, ring centre in the middle half) plus Gaussian noise of deviation ``noise``, and
    their class labels."""
    g = generator
    label = torch.randint(0, _CLASSES, (n,), generator=g)
    period = 3 + 4 * torch.rand(n, 1, 1, generator=g)
    phase = 2 * math.pi * torch.rand(n, 2, 1, 1, generator=g)
    centre = size / 4 + size / 2 * torch.rand(n, 2, 1, 1, generator=g)
    amp = 0.3 + 0.7 * torch.rand(n, 1, 1, generator=g)
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32), indexing="ij")
    w = 2 * math.pi / period
    radius = torch.sqrt((xx - centre[:, 0]) ** 2 + (yy - centre[:, 1]) ** 2)
    patterns = torch.stack(
        [
            torch.sin(w * yy + phase[:, 0]),
            torch.sin(w * xx + phase[:, 0]),
            torch.sin(w * (xx + yy) / math.sqrt(2) + phase[:, 0]),
            torch.sin(w * (xx - yy) / math.sqrt(2) + phase[:, 0]),
            torch.sin(w * xx + phase[:, 0]) * torch.sin(w * yy + phase[:, 1]),
            torch.sin(w * radius + phase[:, 0]),
        ],
        dim=1,
    )
    image = patterns[torch.arange(n), label] * amp + noise * torch.randn(n, size, size, generator=g)
    return image.unsqueeze(1), label


class ShapesNet(nn.Module):
    """Two 3x3 convolutions with max pooling, then two linear layers."""

    def __init__(self, channels: int = 16, hidden: int = 128) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Linear(2 * channels * (_SIZE // 4) ** 2, hidden), nn.ReLU(), nn.Linear(hidden, _CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


@dataclass(frozen=True)
class ShapesTask:
    """Classify generated stripe, checkerboard and ring images; batches seeded by
    (seed, step, rank), the held-out batch by a seed no training step uses. ``side`` and
    ``noise``: the images' side and noise (a subclass with another model may change them)."""

    side: ClassVar[int] = _SIZE
    noise: ClassVar[float] = 0.8
    batch_size: int = 32
    seed: int = 0

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        return shapes_batch(self.batch_size, torch.Generator().manual_seed(_seed(self.seed, step, rank)), self.side, self.noise)

    def eval_batch(self, size: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
        return shapes_batch(size, torch.Generator().manual_seed(2**62 + self.seed), self.side, self.noise)

    def model(self) -> ShapesNet:
        torch.manual_seed(self.seed)
        return ShapesNet()

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)


class CharTransformer(nn.Module):
    """Token and position embeddings, pre-norm causal transformer layers, a final norm and
    a linear head over ASCII."""

    def __init__(self, context: int = 32, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.embed(x) + self.position.weight[:n]
        return self.head(self.norm(self.body(h, mask=self.causal[:n, :n], is_causal=True)))


@dataclass(frozen=True)
class CharTransformerTask:
    """Next-character prediction at every position of a window of the demo's corpus (the
    first 90% for training, the last 10% held out), with a causal transformer: tiny by
    default (the quality suite's), GPT-2-like at larger ``width`` and ``layers``."""

    context: int = 32
    batch_size: int = 32
    seed: int = 0
    width: int = 64
    layers: int = 2
    heads: int = 4

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        win = data[starts[:, None] + torch.arange(self.context + 1)].long()
        return win[:, :-1], win[:, 1:]

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        data = corpus()
        train = data[: int(len(data) * 0.9)]
        g = torch.Generator().manual_seed(_seed(self.seed, step, rank))
        return self._windows(train, torch.randint(0, len(train) - self.context - 1, (self.batch_size,), generator=g))

    def eval_batch(self, size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        data = corpus()
        val = data[int(len(data) * 0.9) :]
        return self._windows(val, torch.linspace(0, len(val) - self.context - 2, size).long())

    def model(self) -> CharTransformer:
        torch.manual_seed(self.seed)
        return CharTransformer(self.context, self.width, self.layers, self.heads)

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
