"""Top-k sparsification by a sampled threshold, and the matching scatter-add decode.

:func:`topk_select` returns exactly the ``k`` entries of largest magnitude (NaN largest, as in
``torch.topk``; ties to the lower index) in increasing index order. A random sample estimates a
threshold slightly more than ``k`` entries reach, one pass keeps those candidates, and the exact
k-th magnitude among them settles the set (too few: a lower threshold, another pass), so the seed
and the device change only the time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from . import _checks
from ._constants import candidate_room, sample_rank
from .cuda import _launch
from .feedback import add_error
from .rng import check_seed, derive_seed

__all__ = ["scatter_add_decode", "topk_select", "topk_select_many"]


def default_sample(n: int) -> int:
    """Entries of an ``n``-element tensor the estimate reads: ``n / 256`` within [4096, 32768]. Each is
    a random read, so mid-sized tensors want few, while huge ones repay more with fewer candidates."""
    return min(1 << 15, max(1 << 12, n >> 8))


_SLACK = 1.25  # aim the threshold at 25% more candidates than k, plus 4 sigma of sampling noise


def _device(flat: torch.Tensor) -> ModuleType:
    """The implementation for ``flat``'s device: ``exact_threshold``, ``sample_threshold``, ``take_top``
    and ``select_candidates`` (increasing indices, with their values where collected)."""
    if flat.is_cuda:
        return _launch
    from .cpu import topk as cpu

    return cpu


def topk_select(
    acc: torch.Tensor, k: int, exact: bool = False, sample: int | None = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the ``k`` largest-magnitude entries of flat ``acc``, zeroing them (``acc`` becomes the
    residual): ``(values, int32 indices)`` in increasing index order. ``exact=True`` skips the sampled
    estimate; ``sample`` (None: :func:`default_sample`) and ``seed`` steer it, never the result."""
    _checks.check_float("acc", acc)
    _checks.check_count("k", k)
    if sample is not None:
        _checks.check_count("sample", sample, 1)
    seed = check_seed(seed)
    if not acc.is_contiguous():
        raise ValueError("acc must be contiguous (it is zeroed in place)")
    flat = acc.view(-1)
    n = flat.numel()
    if k > n:
        raise ValueError(f"k={k} exceeds the number of elements ({n})")
    if n >= 2**31:
        raise ValueError(f"acc has {n} elements; int32 indices allow at most {2**31 - 1}")
    if k == 0:
        return flat.new_empty(0), torch.empty(0, dtype=torch.int32, device=acc.device)
    if not flat.is_cuda and flat.dtype != torch.float32:  # half precision on the CPU: via an exact float32 copy, same entries
        _, chosen = topk_select(flat.float(), k, exact=exact, sample=sample, seed=seed)
        where = chosen.long()
        values = flat.index_select(0, where)
        flat.index_fill_(0, where, 0)
        return values, chosen
    sample = default_sample(n) if sample is None else sample
    impl = _device(flat)
    if exact or sample >= n or k == n:
        candidates, cvalues = impl.select_candidates(flat, impl.exact_threshold(flat, k), k)
    else:
        for widen in itertools.count():  # a threshold that about k * _SLACK * 4**widen entries reach, from the sample
            rank = sample_rank(k, n, sample, _SLACK, widen)
            threshold = -math.inf if rank >= sample else impl.sample_threshold(flat, derive_seed(seed, widen), sample, rank)
            candidates, cvalues = impl.select_candidates(flat, threshold, candidate_room(k, _SLACK, widen))
            if candidates.numel() >= k:
                break
    return impl.take_top(flat, candidates, cvalues, k)


def topk_select_many(
    acc: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    counts: Sequence[int],
    seeds: Sequence[int],
    exact: Sequence[bool],
    grad: torch.Tensor | None = None,
    error: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_select` of every span of bucket ``acc`` in one call: ``torch.cat`` of the per-span
    results, indices *into acc*. With ``grad`` and ``error``, each span is first set to their sum. On
    the CPU one compiled call covers the small tensors (a call each costs more than their selection),
    adding the sum in the threshold pass; a tensor above a thread's share is split over the threads."""
    _checks.check_float("acc", acc)
    if acc.dim() != 1 or not acc.is_contiguous():
        raise ValueError(f"acc must be a flat contiguous buffer, got shape {tuple(acc.shape)}")
    if not len(spans) == len(counts) == len(seeds) == len(exact):
        lengths = ", ".join(str(len(a)) for a in (spans, counts, seeds, exact))
        raise ValueError(f"spans, counts, seeds and exact differ in length: {lengths}")
    if (grad is None) != (error is None):
        raise ValueError("grad and error come together (acc = grad + error), got only one of them")
    if grad is not None:
        _checks.check_float("grad", grad)
        _checks.check_dtype("error", error, torch.float32)
        _checks.check_dtype("acc", acc, torch.float32)
        _checks.check_same_device(acc=acc, grad=grad, error=error)
        if not grad.numel() == error.numel() == acc.numel() or not (grad.is_contiguous() and error.is_contiguous()):
            raise ValueError(f"grad and error must be contiguous and of acc's {acc.numel()} elements")
    for (offset, numel), k in zip(spans, counts):
        _checks.check_count("span offset", offset)
        _checks.check_count("k", k)
        if offset + numel > acc.numel() or k > numel:
            raise ValueError(f"span ({offset}, {numel}) with k={k} does not fit the {acc.numel()} elements of acc")
    if acc.numel() >= 2**31:
        raise ValueError(f"acc has {acc.numel()} elements; int32 indices allow at most {2**31 - 1}")
    out_at = np.cumsum(counts, dtype=np.int64) - np.asarray(counts, np.int64)
    values = acc.new_empty(int(sum(counts)))
    indices = torch.empty(values.numel(), dtype=torch.int32, device=acc.device)
    threads = torch.get_num_threads()
    compiled = acc.dtype == torch.float32 and not acc.is_cuda  # the CPU kernels' batched selection
    if grad is not None and not (compiled and grad.dtype == torch.float32):  # no fused pass: add first
        for offset, numel in spans:
            add_error(grad.narrow(0, offset, numel), error.narrow(0, offset, numel), out=acc.narrow(0, offset, numel))
        grad = error = None
    batch = []
    for t, ((offset, numel), k) in enumerate(zip(spans, counts)):
        if compiled and k and (threads == 1 or numel <= acc.numel() // threads):
            batch.append(t)  # one compiled call below
            continue
        part = acc.narrow(0, offset, numel)
        addends = None if grad is None else (grad.narrow(0, offset, numel), error.narrow(0, offset, numel))
        if addends is not None and k and not exact[t]:
            v, i = _select_summed(part, *addends, k, seeds[t])
        else:
            if addends is not None:
                add_error(*addends, out=part)
            if not k:
                continue
            v, i = topk_select(part, k, exact=exact[t], seed=seeds[t])
        values.narrow(0, int(out_at[t]), k).copy_(v)
        indices.narrow(0, int(out_at[t]), k).copy_(i + offset)
    if batch:
        from .cpu import topk as cpu

        cpu.take_top_many(
            acc,
            None if grad is None else (grad, error),
            np.array([spans[t][0] for t in batch], np.int64),
            np.array([spans[t][1] for t in batch], np.int64),
            np.array([counts[t] for t in batch], np.int64),
            np.array([0 if exact[t] else default_sample(spans[t][1]) for t in batch], np.int64),
            np.array([check_seed(seeds[t]) for t in batch], np.uint64),
            out_at[batch],
            _SLACK,
            values,
            indices,
        )
    return values, indices


def _select_summed(
    part: torch.Tensor, grad: torch.Tensor, error: torch.Tensor, k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_select(part, k, seed=seed)`` after ``part = grad + error``, summed in the candidates' pass."""
    from .cpu import topk as cpu

    n = part.numel()
    sample = default_sample(n)
    rank = sample_rank(k, n, sample, _SLACK, 0)
    if sample < n and k < n and rank < sample:
        threshold = cpu.sample_threshold(part, derive_seed(seed, 0), sample, rank, (grad, error))
        candidates, cvalues = cpu.select_candidates(part, threshold, candidate_room(k, _SLACK, 0), (grad, error))
        if candidates.numel() >= k:
            return cpu.take_top(part, candidates, cvalues, k)
    else:
        add_error(grad, error, out=part)
    return topk_select(part, k, seed=seed)  # part holds the sum; the threshold widens as usual


def scatter_add_decode(
    values: torch.Tensor, indices: torch.Tensor, n: int, out: torch.Tensor, average: bool = True
) -> torch.Tensor:
    """Overwrite ``out`` (``n`` elements) with ``sum_r scatter(values[r] at indices[r]) (/ world)``,
    in rank order in float32; indices are distinct within a rank and add up across ranks. Indices
    outside ``[0, n)`` raise ValueError on the CPU; CUDA skips them (checking would sync every decode)."""
    _checks.check_float("values", values)
    _checks.check_dtype("indices", indices, torch.int32)
    _checks.check_count("n", n)
    _checks.check_out(out, n)
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D [world, k], got shape {tuple(values.shape)}")
    _checks.check_shape("indices", indices, tuple(values.shape))
    _checks.check_same_device(values=values, indices=indices, out=out)
    if out.is_cuda:
        return _launch.scatter_add_decode(values.contiguous(), indices.contiguous(), n, out, average)
    if indices.numel():
        low, high = torch.aminmax(indices)
        if int(low) < 0 or int(high) >= n:
            raise ValueError(f"indices must lie in [0, {n}), got [{int(low)}, {int(high)}]")
    from .cpu import topk as cpu

    cpu.scatter_add_decode(values, indices, n, out, average)
    return out
