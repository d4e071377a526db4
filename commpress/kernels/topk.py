"""Top-k sparsification by a sampled threshold, and the matching scatter-add decode.

:func:`topk_select` returns exactly the ``k`` entries of largest magnitude, ties broken toward
the lower index, in increasing index order. The sampled threshold only makes it cheap: a
random sample estimates a magnitude that slightly more than ``k`` entries exceed, one pass
keeps those candidates, and the exact k-th magnitude among the candidates settles the set.
If the estimate was too high (fewer than ``k`` candidates), the threshold is lowered and the
pass repeated. So the result does not depend on the seed or on the device, only the time
does. NaN magnitudes count as larger than any number (as in ``torch.topk``).
"""

from __future__ import annotations

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
    """How many entries of an ``n``-element tensor the threshold estimate looks at:
    ``n / 256`` within [4096, 32768]. 4096 already put about 51 entries above the
    threshold at a ratio of 1%; each sampled entry is a random read, which on a bucket of
    many mid-sized tensors cost more than the tighter threshold saved (32,768 per tensor
    made a GPT-2 bucket's selection 50% slower), while one tensor of millions repays a
    larger sample with fewer candidates. The result does not depend on it."""
    return min(1 << 15, max(1 << 12, n >> 8))


_SLACK = 1.25  # aim the threshold at 25% more candidates than k, plus 4 sigma of sampling noise


def _device(flat: torch.Tensor) -> ModuleType:
    """The implementation for ``flat``'s device. Both give ``exact_threshold(flat, k)``,
    ``sample_threshold(flat, seed, sample, rank)``, ``select_candidates(flat, threshold,
    expect)`` (increasing indices not below the threshold, and their values where the
    implementation collects them) and ``take_top(flat, candidates, values, k)``."""
    if flat.is_cuda:
        return _launch
    from .cpu import topk as cpu

    return cpu


def topk_select(
    acc: torch.Tensor, k: int, exact: bool = False, sample: int | None = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the ``k`` largest-magnitude entries of flat ``acc`` and zero them in ``acc``.

    Returns ``(values, indices)``: ``values`` in acc's dtype, ``indices`` int32, both of length
    ``k``, in increasing index order. ``acc`` becomes the residual (error-feedback buffer).
    ``exact=True`` skips the sampled estimate (a selection over the whole tensor); ``sample`` is how many
    entries the estimate looks at (None: :func:`default_sample`) and ``seed`` where it
    looks; neither changes the result.
    """
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
    if not flat.is_cuda and flat.dtype != torch.float32:
        return _select_converted(flat, k, exact, sample, seed)
    sample = default_sample(n) if sample is None else sample
    impl = _device(flat)
    if exact or sample >= n or k == n:
        candidates, cvalues = impl.select_candidates(flat, impl.exact_threshold(flat, k), k)
    else:
        widen = 0
        while True:  # a threshold that about k * _SLACK * 4**widen entries reach, from the sample
            rank = sample_rank(k, n, sample, _SLACK, widen)
            threshold = -math.inf if rank >= sample else impl.sample_threshold(flat, derive_seed(seed, widen), sample, rank)
            candidates, cvalues = impl.select_candidates(flat, threshold, candidate_room(k, _SLACK, widen))
            if candidates.numel() >= k:
                break
            widen += 1
    return impl.take_top(flat, candidates, cvalues, k)


def _select_converted(
    flat: torch.Tensor, k: int, exact: bool, sample: int | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_select` of a half-precision CPU tensor: the selection runs on a float32
    copy (float32 holds its magnitudes exactly, so the chosen entries are the same), the
    values are read from ``flat`` and zeroed there."""
    _, chosen = topk_select(flat.float(), k, exact=exact, sample=sample, seed=seed)
    where = chosen.long()
    values = flat.index_select(0, where)
    flat.index_fill_(0, where, 0)
    return values, chosen


def topk_select_many(
    acc: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    counts: Sequence[int],
    seeds: Sequence[int],
    exact: Sequence[bool],
    grad: torch.Tensor | None = None,
    error: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_select` of every tensor of a bucket in one call.

    ``acc`` is the flat buffer, ``spans`` the tensors' ``(offset, numel)`` in it, ``counts``,
    ``seeds`` and ``exact`` the per-tensor ``k``, ``seed`` and ``exact``. With ``grad`` and
    ``error`` (laid out like ``acc``), every span of ``acc`` is first set to
    ``add_error(grad, error)`` there (error feedback's accumulation; ``acc`` outside the
    spans is left as it is). Returns the values and int32 indices *into acc* of all tensors
    end to end: exactly ``torch.cat`` of the per-tensor results, indices shifted by the
    offsets. On the CPU one compiled call covers the tensors (per-tensor calls cost more
    than the selection in a bucket of many small tensors) and adds ``grad + error`` in the
    same pass as the threshold test, so the sum is not read back from memory; a tensor
    larger than a thread's share keeps the per-tensor call, which splits it over the threads.
    """
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
    """``topk_select(part, k, seed=seed)`` after ``part = grad + error`` (float32, compiled CPU
    path), the sum taken by the threads in the pass that finds the candidates."""
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
    """``out = sum_r scatter(values[r] at indices[r]) (/ world)``, summed in rank order in float32.

    ``values`` is float[world, k], ``indices`` int32[world, k] (distinct within a rank, as
    :func:`topk_select` gives them; indices shared by ranks add up). ``out`` (``n`` elements,
    float32/float16/bfloat16) is overwritten and returned. Indices outside ``[0, n)`` raise
    ValueError on the CPU; on CUDA, where reading their range would wait for the device at
    every decode, the kernel skips them.
    """
    _checks.check_float("values", values)
    _checks.check_dtype("indices", indices, torch.int32)
    _checks.check_float("out", out)
    _checks.check_count("n", n)
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D [world, k], got shape {tuple(values.shape)}")
    _checks.check_shape("indices", indices, tuple(values.shape))
    if out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of {n} elements, got shape {tuple(out.shape)}")
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
