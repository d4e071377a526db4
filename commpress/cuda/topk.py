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

import numpy as np
import torch

from . import _backend, _checks, _chunks, rng
from ._constants import candidate_room, sample_rank
from .feedback import add_error

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


def _magnitudes(acc: torch.Tensor) -> torch.Tensor:
    mag = acc.abs()
    if mag.dtype != torch.float32:
        mag = mag.float()
    return torch.nan_to_num_(mag, nan=math.inf, posinf=math.inf)


def _sample_threshold(flat: torch.Tensor, k: int, sample: int, seed: int, widen: int) -> float:
    """A magnitude that about ``k * _SLACK * 4**widen`` of the entries reach, estimated from a sample."""
    n = flat.numel()
    rank = sample_rank(k, n, sample, _SLACK, widen)
    if rank >= sample:
        return -math.inf
    kernels = _backend.compiled()
    if flat.is_cuda:
        from . import _launch

        idx = _launch.sample_indices(seed, sample, n, flat.device)
    elif kernels is not None and flat.dtype == torch.float32:
        return kernels.sample_threshold(flat, seed, sample, rank)
    else:  # index j = floor(draw_j * n / 2**32), as the CUDA kernel computes it
        idx = torch.from_numpy(((rng.bits32(seed, sample).astype(np.uint64) * np.uint64(n)) >> np.uint64(32)).astype(np.int64))
    return torch.kthvalue(_magnitudes(flat[idx]), sample - rank + 1).values.item()


def _candidates(flat: torch.Tensor, threshold: float, expect: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Increasing indices of the entries whose magnitude is not below ``threshold`` (NaN
    included), and their values where the compiled kernel collects them (else None);
    ``expect``, about how many there are, sizes the CPU kernel's buffers."""
    if flat.is_cuda:
        return torch.nonzero(~(_magnitudes(flat) < threshold)).view(-1), None
    kernels = _backend.compiled()
    if kernels is not None and flat.dtype == torch.float32:
        return kernels.select_candidates(flat, threshold, expect)
    limit = np.float32(threshold)

    def body(start: int, stop: int) -> np.ndarray:
        mag = np.abs(_chunks.float32_block(flat, start, stop))
        return np.flatnonzero(~(mag < limit)) + start  # `not <` keeps NaN

    found = _chunks.map_blocks(body, list(_chunks.spans(flat.numel())))
    return torch.from_numpy(np.concatenate(found) if found else np.empty(0, np.int64)), None


def _exact_k(flat: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """Of ``candidates`` (increasing indices, at least k), the k largest magnitudes, ties to lower index."""
    cmag = _magnitudes(flat[candidates])
    count = cmag.numel()
    if count == k:
        return candidates
    kth = torch.kthvalue(cmag, count - k + 1).values
    above = cmag > kth
    ties = cmag == kth
    need = k - int(above.sum())
    keep = above | (ties & (torch.cumsum(ties, 0) <= need))
    return candidates[keep]


def topk_select(
    acc: torch.Tensor, k: int, exact: bool = False, sample: int | None = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the ``k`` largest-magnitude entries of flat ``acc`` and zero them in ``acc``.

    Returns ``(values, indices)``: ``values`` in acc's dtype, ``indices`` int32, both of length
    ``k``, in increasing index order. ``acc`` becomes the residual (error-feedback buffer).
    ``exact=True`` skips the sampled estimate (a full ``kthvalue``); ``sample`` is how many
    entries the estimate looks at (None: :func:`default_sample`) and ``seed`` where it
    looks; neither changes the result.
    """
    _checks.check_float("acc", acc)
    _checks.check_count("k", k)
    if sample is not None:
        _checks.check_count("sample", sample, 1)
    seed = rng._check_seed(seed)
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
    sample = default_sample(n) if sample is None else sample
    kernels = _backend.compiled()
    compiled = kernels is not None and flat.dtype == torch.float32 and not flat.is_cuda
    if exact or sample >= n or k == n:
        if compiled:  # noqa: SIM108  (as one line it is too long)
            threshold = kernels.exact_threshold(flat, k)
        else:
            threshold = torch.kthvalue(_magnitudes(flat), n - k + 1).values.item()
        candidates, cvalues = _candidates(flat, threshold, k)
    else:
        widen = 0
        while True:
            threshold = _sample_threshold(flat, k, sample, rng.derive_seed(seed, widen), widen)
            candidates, cvalues = _candidates(flat, threshold, candidate_room(k, _SLACK, widen))
            if candidates.numel() >= k:
                break
            widen += 1
    if compiled:
        return kernels.take_top(flat, candidates, cvalues, k)
    chosen = _exact_k(flat, candidates, k)
    if flat.is_cuda:
        from . import _launch

        return _launch.gather_and_zero(flat, chosen)
    values = flat[chosen]
    flat[chosen] = 0
    return values, chosen.to(torch.int32)


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
    kernels = _backend.compiled()
    threads = torch.get_num_threads()
    compiled = kernels is not None and acc.dtype == torch.float32 and not acc.is_cuda
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
        kernels.take_top_many(
            acc,
            None if grad is None else (grad, error),
            np.array([spans[t][0] for t in batch], np.int64),
            np.array([spans[t][1] for t in batch], np.int64),
            np.array([counts[t] for t in batch], np.int64),
            np.array([0 if exact[t] else default_sample(spans[t][1]) for t in batch], np.int64),
            np.array([rng._check_seed(seeds[t]) for t in batch], np.uint64),
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
    kernels = _backend.compiled()
    n = part.numel()
    sample = default_sample(n)
    rank = sample_rank(k, n, sample, _SLACK, 0)
    if sample < n and k < n and rank < sample:
        threshold = kernels.sample_threshold(part, rng.derive_seed(seed, 0), sample, rank, (grad, error))
        candidates, cvalues = kernels.select_candidates(part, threshold, candidate_room(k, _SLACK, 0), (grad, error))
        if candidates.numel() >= k:
            return kernels.take_top(part, candidates, cvalues, k)
    else:
        add_error(grad, error, out=part)
    return topk_select(part, k, seed=seed)  # part holds the sum; the threshold widens as usual


def scatter_add_decode(
    values: torch.Tensor, indices: torch.Tensor, n: int, out: torch.Tensor, average: bool = True
) -> torch.Tensor:
    """``out = sum_r scatter(values[r] at indices[r]) (/ world)``, summed in rank order in float32.

    ``values`` is float[world, k], ``indices`` int32[world, k] (distinct within a rank, as
    :func:`topk_select` gives them; indices shared by ranks add up). ``out`` (``n`` elements,
    float32/float16/bfloat16) is overwritten and returned.
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
    world = values.shape[0]
    if indices.numel():
        low, high = torch.aminmax(indices)
        if int(low) < 0 or int(high) >= n:
            raise ValueError(f"indices must lie in [0, {n}), got [{int(low)}, {int(high)}]")
    if out.is_cuda:
        from . import _launch

        return _launch.scatter_add_decode(values.contiguous(), indices.contiguous(), n, out, average)
    kernels = _backend.compiled()
    if kernels is not None:
        kernels.scatter_add_decode(values, indices, n, out, average)
        return out
    flat = out.view(-1)
    acc = torch.zeros(n, dtype=torch.float32) if flat.dtype != torch.float32 else flat.zero_()
    for r in range(world):
        acc.index_add_(0, indices[r].long(), values[r].float())
    if average and world > 1:
        acc.div_(world)
    if acc is not flat:
        flat.copy_(acc)
    return out
