"""The settings a layer-wise plan chooses from (the method's
:meth:`~commpress.compressors.base.Compressor.ladder`), and what each loses on a tensor (its
:meth:`~commpress.compressors.base.Compressor.error_model`): the squared L2 distance, on this
rank, between what the tensor owes (gradient plus error feedback's carry) and what it would send."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from commpress.compressors import Compressor, Setting, available, build, compressor_class
from commpress.compressors.tensor_stats import TensorStats
from commpress.errors import ConfigError

__all__ = ["SAMPLE", "candidates", "sample_rows", "tensor_errors"]


def candidates(method: str, params: Mapping[str, Any]) -> list[Setting]:
    """The settings a plan may give a tensor of ``method`` with ``params``; the configured
    setting first. Refuses a method without a ladder, naming those with one."""
    settings = build(method, params).ladder(params)
    if settings is None:
        planned = [m for m in available() if compressor_class(m).ladder is not Compressor.ladder]
        raise ConfigError(
            f"[layerwise] enabled = true is not accepted with method = {method!r}: it plans a method's setting per "
            f"tensor; accepted methods: {', '.join(planned)}"
        )
    return settings


def tensor_errors(compressors: Sequence[Compressor], shape: tuple[int, ...], acc: torch.Tensor) -> list[float]:
    """The error of each of ``compressors`` (one per candidate) on the tensor of ``shape`` that
    owes ``acc``, measured on :func:`sample_rows`; an empty tensor loses nothing."""
    acc = acc.detach().to(torch.float32).reshape(-1)
    if not acc.numel():
        return [0.0] * len(compressors)
    rows, factor, energy = sample_rows(acc, tuple(shape))
    stats = TensorStats(acc, tuple(shape), rows, factor, energy)
    models = [c.error_model(stats) for c in compressors]  # each asks for what it reads first
    for c, model in zip(compressors, models):
        if model is None:
            raise ConfigError(f"[layerwise]: method {c.name!r} has no error model (Compressor.error_model)")
    return [model() for model in models]


#: Elements a tensor's errors are measured on, at most (about: whole rows).
SAMPLE = 1 << 16
_MIN_ROWS = 16  # a sample keeps at least this many rows, else the whole tensor is measured


def sample_rows(acc: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, float, float | None]:
    """What a tensor's errors are measured on: every t-th row of ``acc`` as a ``shape[0]``-row
    matrix, t the smallest stride keeping about :data:`SAMPLE` elements (the same rows on every
    rank); the factor from the sample's errors to the tensor's, its energy over the sample's (a
    ratio estimate: rows of unequal scale do not bias every candidate alike); the whole tensor's
    energy. A small, 1-D or few-row tensor is measured whole (factor 1, energy None)."""
    numel = acc.numel()
    stride = -(-numel // SAMPLE)
    if len(shape) < 2 or stride <= 1 or shape[0] // stride < _MIN_ROWS:
        return acc, 1.0, None
    rows = acc.view(shape[0], -1)[::stride].reshape(-1)
    sampled = float(rows.square().sum(dtype=torch.float64))
    whole = float(acc.square().sum(dtype=torch.float64))
    if not (math.isfinite(whole) and sampled > 0):  # a non-finite step, or zero rows: by count
        return rows, numel / rows.numel(), whole
    return rows, whole / sampled, whole
