"""The compressors' kernels loaded at registration, before the first step.

numba and NVRTC kernels compile (or load from cache) at their first call, which inside a step
is on the step's clock while the peers wait. :func:`load_kernels` runs every method group once
on values shaped like its tensors, in a two-rank :class:`~commpress.comm.SimulatedWorld` (one
rank, or equal or zero values, would skip paths), so training takes no new paths. Its
compressors are fresh copies: the groups' state, counters and random streams stay as they were.
DDP's buckets are not known in advance, so each group's distinct shapes are reduced together,
then each alone (reaching both the batched and the per-tensor calls).
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
    """:func:`load_kernels` of a model's trainable parameters, per dtype and device."""
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
    """Reduce values of ``dtype`` on ``device`` shaped like the ``(name, shape)`` tensors ``named``,
    in the buckets of :func:`layouts`, each group's apart (as ``Composite`` hands them over)."""
    ranks = [_fresh(groups) for _ in range(WORLD)]
    for index, slots in layouts(groups, named):
        by_key: dict[str, list[ParamSlot]] = {}
        for slot in slots:
            by_key.setdefault(groups.key_for(slot.name), []).append(slot)
        for key, members in by_key.items():
            if key not in ranks[0] or dtype not in ranks[0][key].dtypes:
                continue  # a group made later (a plan's), or a dtype refused at registration
            laid, numel = lay_out((s.name, s.shape) for s in members)
            reductions = [
                own[key].reduce(Bucket(index, _values(numel, dtype, device, rank), laid), Context(rank, WORLD, step))
                for rank, own in enumerate(ranks)
            ]
            SimulatedWorld(WORLD).run(reductions)


def layouts(groups: MethodGroups, named: Iterable[tuple[str, Sequence[int]]]) -> list[tuple[int, tuple[ParamSlot, ...]]]:
    """The buckets ``(index, slots)``: each group's distinct shapes together, then each alone."""
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    for name, shape in named:
        if torch.Size(shape).numel():
            seen.setdefault((groups.key_for(name), tuple(shape)), name)
    together, _ = lay_out((name, shape) for (_, shape), name in seen.items())
    alone = [lay_out([(name, shape)])[0] for (_, shape), name in seen.items()] if len(seen) > 1 else []
    return [(0, together), *enumerate(alone, start=1)] if seen else []


def _values(numel: int, dtype: torch.dtype, device: torch.device | str | None, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(numel, generator=generator).to(device=device, dtype=dtype)


def _fresh(groups: MethodGroups) -> dict[str, Compressor]:
    """A new compressor per group from the settings in force, with the group's momentum (or 0)."""
    fresh = {}
    for key, (method, params) in groups.specs.items():
        compressor = build(method, params)
        own = groups.compressors[key]
        if compressor.applies_momentum and compressor.momentum is None:
            compressor.momentum = own.momentum if own.momentum is not None else 0.0
        fresh[key] = compressor
    return fresh
