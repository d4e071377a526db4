"""The settings a layer-wise plan chooses from, and what each loses on one tensor.

Both are the method's own: its ladder (:meth:`~commpress.compressors.base.Compressor.ladder`:
its knob around the configured setting, then other methods' settings) and each setting's
error model (:meth:`~commpress.compressors.base.Compressor.error_model`). The error of a
setting on a tensor is the squared L2 distance between what the tensor owes (its gradient
plus, with error feedback, what its method carries:
:meth:`~commpress.compressors.base.Compressor.owed`) and what the setting would send of it,
on this rank. Here: the refusal of a method without a ladder, and the rows a tensor's
errors are measured on.
"""

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
    """The error of each of ``compressors`` (one per candidate setting) on the tensor of
    ``shape`` that owes ``acc`` (flat, float32); a tensor of more than :data:`SAMPLE`
    elements is measured on a strided sample of its rows (:func:`sample_rows`), but for
    the low-rank settings. An empty tensor loses nothing."""
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
    """What a tensor's errors are measured on: every t-th row of ``acc`` as a matrix of
    ``shape[0]`` rows, t the smallest stride that keeps about :data:`SAMPLE` elements; the
    factor from the sample's errors to the tensor's: the tensor's energy over the sample's
    (a ratio estimate: rows of unequal scale do not bias every candidate of the tensor
    alike); and that energy of the whole tensor, found on the way. The whole tensor
    (factor 1, energy None: its errors find it) when it is small, 1-D, or would keep fewer
    than 16 rows. The same rows on every rank. Low-rank errors are not sampled (the top
    singular values of fewer rows take a larger share of the tail): they read them off the
    whole matrix. Measuring stays a few hundred ms per plan on a 6M-parameter model
    (docs/benchmarks.md)."""
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
