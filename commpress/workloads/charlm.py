"""The demo task: next-character prediction on Python's own standard-library sources.

Real text that ships with every Python, so nothing is downloaded. The model is a small
MLP over a window of characters; its weight matrices have realistic shapes for the
low-rank and sparse compressors.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

__all__ = ["CharMLP", "CharTask", "corpus"]

#: Standard-library modules whose source text is the corpus (present in every CPython 3.11+).
CORPUS_MODULES = ("argparse", "textwrap", "difflib", "dataclasses", "inspect")
VOCAB = 128  # ASCII; other bytes map to '?'


@lru_cache(maxsize=1)
def corpus() -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor of ASCII codes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((stdlib / f"{m}.py").read_bytes() for m in CORPUS_MODULES)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()
    data[data >= VOCAB] = ord("?")
    return data


class CharMLP(nn.Module):
    """Embedding of a ``context``-character window, two hidden layers, logits over ASCII."""

    def __init__(self, context: int = 32, embed: int = 24, hidden: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.body = nn.Sequential(
            nn.Linear(context * embed, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, VOCAB),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x).flatten(1))


@dataclass(frozen=True)
class CharTask:
    """Batches for rank ``rank`` of ``world_size``: each rank draws its own windows from
    the first 90% of the corpus, seeded by (seed, step, rank); the last 10% is held out."""

    context: int = 32
    batch_size: int = 32
    seed: int = 0

    def _split(self) -> tuple[torch.Tensor, torch.Tensor]:
        data = corpus()
        cut = int(len(data) * 0.9)
        return data[:cut], data[cut:]

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.context + 1)
        win = data[idx].long()
        return win[:, :-1], win[:, -1]

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) for one step on one rank."""
        train, _ = self._split()
        g = torch.Generator().manual_seed(((self.seed * 1_000_003 + step) * 4099 + rank) % (2**63))
        starts = torch.randint(0, len(train) - self.context - 1, (self.batch_size,), generator=g)
        return self._windows(train, starts)

    def eval_batch(self, size: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed held-out batch for the final loss."""
        _, val = self._split()
        starts = torch.linspace(0, len(val) - self.context - 2, size).long()
        return self._windows(val, starts)

    def model(self) -> CharMLP:
        """A freshly initialized model, identical on every rank for the same seed."""
        torch.manual_seed(self.seed)
        return CharMLP(self.context)
