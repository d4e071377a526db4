"""The settings a layer-wise plan chooses from, and what each loses on one tensor.

A method's candidate settings are its own knob around the configured one (Top-k densities
from 1/8 to 64 times the configured ratio, low-rank ranks from 1/4 to 8 times the
configured rank, TernGrad as configured), for Top-k and TernGrad also PowerSGD at a few
ranks (a large layer's gradient is close to low rank), and a ladder of other methods by
bits per element: ``onebit`` (a scale per 64 elements, error feedback), ``terngrad``,
4-bit ``quant`` (error feedback), ``fp16``, ``none``. Mixing methods lets a plan send a
small, sensitive tensor in 4 bits where the main method's setting would need many times
its bytes, and a large matrix at low rank where Top-k would keep too few entries
(measured: docs/choosing.md). Top-k with DGC applies the optimizer's momentum itself, so
its tensors keep it: its settings are densities only, up to 1 (every entry sent).

The error of a setting on a tensor is the squared L2 distance between what the tensor
owes (its gradient plus, with error feedback, the residual its method carries) and what
the setting would send of it, on this rank:

- Top-k at density d: the squares of every entry but the k = ceil(d n) largest (0 for a
  tensor under ``min_numel``, sent whole);
- PowerSGD / ACP-SGD at rank r: the squared singular values beyond r of the tensor as a
  matrix (the best rank-r approximation, which the warm-started power iteration
  approaches), its energy less that of the top r (:func:`top_singular`); 0 where the
  tensor is sent uncompressed;
- TernGrad: the clipping error plus the variance of stochastic rounding, ``s|c| - c^2``
  per clipped element c with scale s;
- onebit: what the mean magnitude times the sign misses, ``sum a^2 - n s^2`` per run of n
  elements with scale s = mean |a|;
- quant: the variance of stochastic rounding, ``step^2 f (1 - f)`` per element (f its
  fraction of a step above its bucket's minimum);
- fp16 / bf16: the rounding error; ``none``: 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from commpress.compressors import Compressor, ParamSlot
from commpress.compressors.lowrank import LowRankCompressor
from commpress.compressors.lowrank_plan import matrix_shape
from commpress.compressors.onebit import OneBitCompressor
from commpress.compressors.quant import QuantCompressor
from commpress.compressors.terngrad import TernGradCompressor
from commpress.compressors.topk import TopKCompressor, topk_count
from commpress.errors import ConfigError

__all__ = ["PLANNED", "SAMPLE", "Setting", "candidates", "owed", "sample_rows", "tensor_errors", "top_singular", "top_sums"]

#: The methods a layer-wise plan can set per tensor.
PLANNED = ("topk", "powersgd", "acpsgd", "terngrad")
#: (method, params): one setting.
Setting = tuple[str, dict[str, Any]]
_DENSITY_STEPS = range(-3, 7)  # density = configured ratio * 2**j
_RANK_STEPS = range(-2, 4)  # rank = configured rank * 2**j
#: The PowerSGD ranks Top-k's and TernGrad's tensors may take. TernGrad's start at 4: ranks 1
#: and 2 took its place on matrices it sends well and cost it 2.8 points on the transformer
#: and 26 on resnet under AdamW (docs/choosing.md, measured).
POOL_RANKS = {"topk": (1, 2, 4, 8), "terngrad": (4, 8)}


def candidates(method: str, params: Mapping[str, Any]) -> list[Setting]:
    """The settings a plan may give a tensor of ``method`` with ``params``; the configured
    setting first."""
    configured: Setting = (method, dict(params))
    if method not in PLANNED:
        raise ConfigError(
            f"[layerwise] enabled = true is not accepted with method = {method!r}: it plans a method's setting per "
            f"tensor; accepted methods: {', '.join(PLANNED)}"
        )
    if method == "topk":
        ratio = float(params.get("ratio", 0.01))
        dgc = bool(params.get("dgc", False))
        # (index, value) pairs of 8 bytes: from half the entries on, none sends fewer bytes
        top = 1.0 if dgc else 0.5
        densities = sorted({min(top, ratio * 2.0**j) for j in _DENSITY_STEPS} | ({1.0} if dgc else set()))
        settings = [_topk(params, d) for d in densities if d != ratio and (d < top or dgc)]
    elif method == "terngrad":
        settings = []
    else:
        rank = int(params.get("rank", 4))
        ranks = sorted({max(1, int(rank * 2.0**j)) for j in _RANK_STEPS})
        settings = [(method, {**params, "rank": r}) for r in ranks if r != rank]
    if method == "topk" and params.get("dgc"):
        return [configured, *settings]
    return [configured, *settings, *_pool(method, params)]


def _pool(method: str, params: Mapping[str, Any]) -> list[Setting]:
    """The settings every method's tensors may take besides its own: for Top-k and
    TernGrad, PowerSGD at :data:`POOL_RANKS` (on matrices; a large layer's gradient is
    close to low rank, and rank r costs ``r (n + m)`` floats, below Top-k 1% of a
    512 x 768 matrix up to r = 6); for every method, from about 1.5 to 32 bits per
    element: onebit with a scale per 64 elements and 4-bit codes (both with error
    feedback), TernGrad, fp16, none; tensors under the method's ``min_numel`` stay whole."""
    small = {"min_numel": int(params["min_numel"])} if "min_numel" in params else {}
    pool: list[Setting] = [("powersgd", {"rank": r}) for r in POOL_RANKS.get(method, ())]
    pool += [("onebit", {**small, "chunk": 64}), ("quant", {**small, "bits": 4, "error_feedback": True})]
    if method != "terngrad":
        pool.append(("terngrad", {}))
    return [*pool, ("none", {}), ("fp16", {})]


def _topk(params: Mapping[str, Any], ratio: float) -> Setting:
    out = {**params, "ratio": ratio}
    if out.get("warmup_steps"):
        out["warmup_ratio"] = max(float(out.get("warmup_ratio", 0.25)), ratio)
    return "topk", out


def owed(compressor: Compressor, entries: Mapping[str, Any]) -> torch.Tensor | None:
    """What one tensor owes beyond its next gradient under ``compressor``, from its entries
    of the compressor's state (state key -> tensor): the residual of Top-k, onebit or quant,
    with DGC the velocity plus the momentum's next contribution (``v + m u``), the low-rank
    error; None where it owes nothing."""
    if isinstance(compressor, TopKCompressor) and compressor.dgc:
        v, u = entries.get("velocity"), entries.get("momentum")
        if v is None or u is None:
            return v if u is None else u * (compressor.momentum or 0.0)
        return v + u * (compressor.momentum or 0.0)
    if "residuals" in compressor.per_rank_state:
        return entries.get("residuals")
    if isinstance(compressor, LowRankCompressor):
        return entries.get("error")
    return None


def tensor_errors(compressors: Sequence[Compressor], shape: tuple[int, ...], acc: torch.Tensor) -> list[float]:
    """The error of each of ``compressors`` (one per candidate setting) on the tensor of
    ``shape`` that owes ``acc`` (flat, float32); a tensor of more than :data:`SAMPLE`
    elements is measured on a strided sample of its rows (:func:`sample_rows`), but for
    the low-rank settings."""
    acc = acc.detach().to(torch.float32).reshape(-1)
    rank = max((c.rank for c in compressors if isinstance(c, LowRankCompressor)), default=0)
    rows, factor, energy = sample_rows(acc, tuple(shape))
    counts = [topk_count(c.ratio, rows.numel()) for c in compressors if isinstance(c, TopKCompressor)]
    stats = _Stats(acc, tuple(shape), rows, factor, energy, counts, rank)
    return [_error(c, stats) for c in compressors]


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
    singular values of fewer rows take a larger share of the tail): :func:`top_singular`
    reads them off the whole matrix. Measuring stays a few hundred ms per plan on a
    6M-parameter model (docs/benchmarks.md)."""
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


#: :func:`top_singular` works exactly (``svdvals``) on matrices whose smaller side is at
#: most this many times the rank asked for; beyond, by a block power iteration.
_EXACT_SIDE = 4
_POWER_STEPS = 2  # power iterations: Ritz values within a few % of the top singular values
_OVERSAMPLE = 8  # extra columns beyond the rank asked for


def top_singular(a: torch.Tensor, k: int) -> torch.Tensor:
    """The largest singular values of the matrix ``a`` (float32 or float64), at least ``k``
    of them (fewer only if ``a`` has fewer), in float64, largest first: all of them by
    ``svdvals`` where the smaller side is small, else the Ritz values of a block power
    iteration (``k + 8`` columns, 2 steps, a fixed start: every rank and run computes the
    same), each at most the true value, so an error read off them is an upper bound; the
    full SVD of a 11,238 x 172 embedding took most of a plan's measuring."""
    n, m = a.shape
    if min(n, m) <= _EXACT_SIDE * max(k, 1):
        return torch.linalg.svdvals(a.to(torch.float64))
    a = a if n >= m else a.T  # tall: n >= m
    start = torch.Generator(device="cpu").manual_seed(0)
    basis = torch.randn(a.shape[1], k + _OVERSAMPLE, generator=start).to(a.device, a.dtype)
    y = torch.linalg.qr(a @ basis).Q
    for _ in range(_POWER_STEPS):
        y = torch.linalg.qr(a @ torch.linalg.qr(a.T @ y).Q).Q
    return torch.linalg.svdvals((y.T @ a).to(torch.float64))


def top_sums(values: torch.Tensor, counts: Iterable[int]) -> dict[int, float]:
    """For each k of ``counts`` (1 <= k <= numel), the sum in float64 of the k largest of
    ``values`` (float32, finite, >= 0, flat, contiguous), without sorting them on the CPU
    (:func:`_radix_sums`). On CUDA a sort is fast, and the histogram's weighted bin counts
    would add in an order that changes from run to run: the sums are read off a sort."""
    ks = sorted(set(counts))
    return _sorted_sums(values, ks) if values.is_cuda else _radix_sums(values, ks)


def _sorted_sums(values: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """:func:`top_sums` by definition: the cumulative sums of the values sorted, largest first."""
    kept = values.sort(descending=True).values.cumsum(0, dtype=torch.float64)
    return dict(zip(ks, kept[torch.tensor(ks, device=values.device) - 1].tolist()))


#: :func:`_radix_sums` bins a float32 by its 12 bits after the sign: the exponent and the
#: top 4 mantissa bits (4,096 bins: few to clear for a sample of 65,536 elements), so a
#: bin's values are within a factor 1 + 2**-4 of each other.
_RADIX_SHIFT = 19


def _radix_sums(values: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """:func:`top_sums` by a radix selection. The bits of a non-negative float32 read as an
    integer order like the number, so one histogram of their top bits (each bin's count and
    float64 sum) gives, for every k, the bin holding the k-th largest value and the sum of
    every bin above it; only the entries of those few bins are sorted."""
    bins = values.view(torch.int32) >> _RADIX_SHIFT
    size = 1 << (31 - _RADIX_SHIFT)
    above = torch.bincount(bins, minlength=size).flip(0).cumsum(0)  # above[i]: entries in the top i + 1 bins
    sums = torch.bincount(bins, weights=values.double(), minlength=size).flip(0).cumsum(0)
    tops = torch.searchsorted(above, torch.tensor(ks)).tolist()  # the bin of each k-th largest, from the top
    boundary = torch.zeros(size, dtype=torch.bool)
    boundary[[size - 1 - i for i in tops]] = True
    where = boundary[bins].nonzero().squeeze(1)
    inside, inside_bins = values[where], bins[where]
    out = {}
    for k, i in zip(ks, tops):
        count, total = (int(above[i - 1]), float(sums[i - 1])) if i else (0, 0.0)
        rest = inside[inside_bins == size - 1 - i].sort(descending=True).values[: k - count]
        out[k] = total + float(rest.sum(dtype=torch.float64))
    return out


class _Stats:
    """What several settings' errors share, computed once on the measured rows ``acc``
    (:func:`sample_rows`; ``whole`` is the tensor, ``whole_energy`` its energy where the
    sample found it): the squares (float32, like the tensor, summed in float64) and their
    total, the sums of the largest squares for the Top-k ``counts``, the rows in float64;
    the whole tensor's singular values and energy."""

    def __init__(
        self,
        whole: torch.Tensor,
        shape: tuple[int, ...],
        acc: torch.Tensor,
        factor: float,
        whole_energy: float | None,
        counts: Sequence[int],
        rank: int,
    ) -> None:
        self.whole, self.shape, self.acc, self.factor = whole, shape, acc, factor
        self._whole_energy, self.counts, self.rank = whole_energy, counts, rank
        self._singular: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def numel(self) -> int:
        """The tensor's elements (the measured rows may be fewer)."""
        return self.whole.numel()

    @functools.cached_property
    def double(self) -> torch.Tensor:
        return self.acc.to(torch.float64)

    @functools.cached_property
    def squares(self) -> torch.Tensor:
        return self.acc.square()

    @functools.cached_property
    def energy(self) -> float:
        return float(self.squares.sum(dtype=torch.float64))

    @functools.cached_property
    def kept(self) -> dict[int, float]:
        """What k entries send (the sum of the k largest squares), for each k of ``counts``."""
        if not math.isfinite(self.energy):  # a non-finite step, discarded: nothing to search
            return dict.fromkeys(self.counts, self.energy)
        return top_sums(self.squares, self.counts)

    @property
    def whole_energy(self) -> float:
        """The tensor's energy: the sample's finding, or the measured rows' when they are the tensor."""
        return self.energy if self._whole_energy is None else self._whole_energy

    def singular(self, n: int, m: int) -> torch.Tensor:
        """The largest singular values of the tensor as an n x m matrix, at least the
        largest rank asked for (:func:`top_singular`), largest first."""
        if (n, m) not in self._singular:
            self._singular[n, m] = top_singular(self.whole.view(n, m), self.rank)
        return self._singular[n, m]


def _error(c: Compressor, stats: _Stats) -> float:
    """The error of ``c`` on the tensor: the low-rank error on the whole matrix, the others
    on its measured rows times their factor."""
    if stats.numel == 0 or c.name == "none" or stats.numel < getattr(c, "min_numel", 0):
        return 0.0  # exact, or a tensor under the method's min_numel: sent whole
    if isinstance(c, TopKCompressor) and topk_count(c.ratio, stats.numel) == stats.numel:
        return 0.0  # every entry sent: exact
    if isinstance(c, LowRankCompressor):
        shape = matrix_shape(ParamSlot("t", torch.Size(stats.shape), 0), c.rank, c.min_compression_rate)
        if shape is None:
            return 0.0
        s = stats.singular(*shape)
        if len(s) == min(shape):  # every singular value: the tail itself
            return float(s[c.rank :].square().sum())
        return max(0.0, stats.whole_energy - float(s[: c.rank].square().sum()))
    return stats.factor * _rows_error(c, stats)


def _rows_error(c: Compressor, stats: _Stats) -> float:
    """The error of ``c`` (not low-rank) on the measured rows."""
    if c.name in ("fp16", "bf16"):
        wire = stats.acc.to(torch.float16 if c.name == "fp16" else torch.bfloat16).float()
        return float((stats.acc - wire).square().sum(dtype=torch.float64))  # the difference is exact in float32
    if isinstance(c, TopKCompressor):
        return max(0.0, stats.energy - stats.kept[topk_count(c.ratio, stats.acc.numel())])
    if isinstance(c, OneBitCompressor):
        return max(0.0, stats.energy - _sign_kept(stats.double, c.chunk))
    if isinstance(c, QuantCompressor):
        return _quant_error(stats.double, c.bits, c.bucket_size)
    if isinstance(c, TernGradCompressor):
        a = stats.double.abs()
        scale = float(stats.whole.abs().max())  # the tensor's scale, not the rows'
        if c.clip_sigma:
            scale = min(scale, c.clip_sigma * math.sqrt(stats.whole_energy / stats.numel))
        clipped = a.clamp(max=scale)
        return float((a - clipped).square().sum() + (scale * clipped - clipped.square()).sum())
    raise ConfigError(f"[layerwise]: method {c.name!r} has no error model; accepted methods: {', '.join(PLANNED)}")


def _rows(acc: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``acc`` as rows of ``n`` elements, the last, shorter run as a row of its own."""
    whole = acc.numel() // n * n
    rows = [acc[:whole].view(-1, n)] if whole else []
    if whole < acc.numel():
        rows.append(acc[whole:].view(1, -1))
    return rows


def _sign_kept(acc: torch.Tensor, chunk: int) -> float:
    """``sum n s^2`` over the runs of ``chunk`` elements (the whole tensor for 0) with s the
    run's mean magnitude: the energy a scaled sign keeps."""
    return sum(float(r.abs().mean(1).square().sum() * r.shape[1]) for r in _rows(acc, chunk or acc.numel()))


def _quant_error(acc: torch.Tensor, bits: int, bucket_size: int) -> float:
    """Stochastic rounding's variance, ``s^2 f (1 - f)`` per element, f the fraction of its
    step above the bucket's minimum."""
    total = 0.0
    for rows in _rows(acc, bucket_size):
        lo = rows.min(1, keepdim=True).values
        step = (rows.max(1, keepdim=True).values - lo) / (2**bits - 1)
        f = ((rows - lo) / step.clamp(min=torch.finfo(rows.dtype).tiny)).frac()
        total += float((f * (1 - f) * step.square()).sum())
    return total
