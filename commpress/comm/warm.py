"""The compressors' kernels loaded at registration, before the first step.

A compiled CPU kernel (numba, ``cache=True``) is compiled or read from numba's on-disk
cache at its first call in a process: seconds per op family on an empty cache, tenths of
a second from it; a CUDA kernel is compiled by NVRTC at its first launch. Inside a
training step that time is on the step's clock, and the peers wait for it at the step's
collective. :func:`load_kernels` runs every method group once at registration on values
shaped like the tensors it will reduce, in a simulated world of two ranks
(:class:`~commpress.comm.SimulatedWorld`: nothing is sent; a world of one would skip the
kernels that divide by the world), each rank's values its own normal draws (a payload
equal to a rank's own is not entropy-decoded, and zeros would miss the paths that data
takes), so that the same size-dependent paths (a tensor sent
whole under ``min_numel``, Top-k's exact selection up to 65,536 elements and sampled
above, a bucket's batched call or a large tensor's own) reach the same kernels as
training. It runs compressors built afresh from the groups' settings, never the groups'
own: their state (error feedback, warm starts, what a step staged), the step counters and
the traffic counts stay as they were, and as the compressors draw their random numbers
from keys of (seed, rank, step, tensor), no generator's stream moves.

The buckets need not be known in advance (DDP makes them, and remakes them after the first
step): every distinct shape of each group is reduced once, all of them in one bucket, then
each alone (with several threads a tensor larger than one thread's share of its bucket
takes the per-tensor call, a smaller one the batched call).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from commpress.comm.simulated import SimulatedWorld
from commpress.compressors import Bucket, Compressor, Context, ParamSlot, build, lay_out
from commpress.config.groups import MethodGroups

__all__ = ["WORLD", "layouts", "load_kernels", "load_model_kernels"]

#: the ranks of the simulated world the methods run in
WORLD = 2


def load_model_kernels(groups: MethodGroups, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], step: int = 0) -> None:
    """:func:`load_kernels` of a model's trainable parameters ``named_parameters`` (name,
    parameter), per dtype and device."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.Size]]] = {}
    for name, p in named_parameters:
        if p.requires_grad:
            by_kind.setdefault((p.dtype, p.device), []).append((name, p.shape))
    for (dtype, device), named in by_kind.items():
        load_kernels(groups, named, dtype, device, step)


def load_kernels(
    groups: MethodGroups,
    named: Iterable[tuple[str, Sequence[int]]],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    step: int = 0,
) -> None:
    """Reduce values of ``dtype`` on ``device`` shaped like the tensors ``named`` (name,
    shape), laid out as :func:`layouts` gives, by fresh copies of the compressor of the
    group ``groups.key_for`` names (each group's tensors as one bucket of their own, as
    :class:`~commpress.compressors.composite.Composite` hands them over), at ``step``, in
    a simulated world of :data:`WORLD` ranks."""
    ranks = [_fresh(groups) for _ in range(WORLD)]
    for index, slots in layouts(groups, named):
        by_key: dict[str, list[ParamSlot]] = {}
        for slot in slots:
            by_key.setdefault(groups.key_for(slot.name), []).append(slot)
        for key, members in by_key.items():
            if key not in ranks[0] or dtype not in ranks[0][key].dtypes:
                continue  # a group made after the groups were (a plan's), or a dtype it refuses at registration
            laid, numel = lay_out((s.name, s.shape) for s in members)
            reductions = [
                own[key].reduce(Bucket(index, _values(numel, dtype, device, rank), laid), Context(rank, WORLD, step))
                for rank, own in enumerate(ranks)
            ]
            SimulatedWorld(WORLD).run(reductions)


def layouts(groups: MethodGroups, named: Iterable[tuple[str, Sequence[int]]]) -> list[tuple[int, tuple[ParamSlot, ...]]]:
    """The buckets ``(index, slots)`` that reach the kernels the tensors ``named`` (name,
    shape) reach in any buckets: each group's distinct shapes once (the first tensor of
    each shape names it), all in one bucket, then each in a bucket of its own."""
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    for name, shape in named:
        if torch.Size(shape).numel():
            seen.setdefault((groups.key_for(name), tuple(shape)), name)
    together, _ = lay_out((name, shape) for (_, shape), name in seen.items())
    alone = [lay_out([(name, shape)])[0] for (_, shape), name in seen.items()] if len(seen) > 1 else []
    return [(0, together), *enumerate(alone, start=1)] if seen else []


def _values(numel: int, dtype: torch.dtype, device: torch.device | str | None, rank: int) -> torch.Tensor:
    """Rank ``rank``'s gradient: normal values from a generator of its own (no other
    generator's stream moves), different on every rank, as a gradient is (a payload equal
    to a rank's own is not decoded, and zeros everywhere would miss the paths of data)."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(numel, generator=generator).to(device=device, dtype=dtype)


def _fresh(groups: MethodGroups) -> dict[str, Compressor]:
    """A new compressor per group, built from the settings in force; one that applies the
    optimizer's momentum takes the group's (or 0 before it is handed over: the kernels are
    the same)."""
    fresh = {}
    for key, (method, params) in groups.specs.items():
        compressor = build(method, params)
        own = groups.compressors[key]
        if compressor.applies_momentum and compressor.momentum is None:
            compressor.momentum = own.momentum if own.momentum is not None else 0.0
        fresh[key] = compressor
    return fresh
