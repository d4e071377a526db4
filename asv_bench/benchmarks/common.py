"""Shared set-up: which methods and devices to benchmark, and gradient buckets."""

from __future__ import annotations

import torch

from commpress.compressors import Bucket, available, build
from commpress.errors import ConfigError
from commpress.workloads.shaped import load_shapes


def methods() -> list[str]:
    """Every registered compressor (new methods appear here by themselves)."""
    return available()


def devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def compressor(method: str):
    """The method with its default parameters; NotImplementedError (asv: skip) if it has none."""
    try:
        return build(method)
    except ConfigError as exc:
        raise NotImplementedError(f"{method} has no default parameters: {exc}") from None


def gpt2_bucket(scale: float, device: str, seed: int, index: int = 0) -> Bucket:
    """One bucket holding every GPT-2-small layer shape at ``scale``, random gradients."""
    g = torch.Generator().manual_seed(seed)
    shapes = load_shapes("gpt2", scale)
    tensors = [torch.randn(shape, generator=g) * 1e-3 for _, shape in shapes]
    bucket = Bucket.from_tensors(index, tensors, [name for name, _ in shapes])
    bucket.buffer = bucket.buffer.to(device)
    return bucket
