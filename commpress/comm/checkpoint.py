"""Per-rank state in checkpoints: each state says whose it is, and every rank takes back its own.

Error feedback and similar residuals differ per rank. A *part* (``state_dict()``) records
``rank``, ``world_size``, ``step`` and ``config``; a *whole job* (``state_dict(full=True)``, a
collective) is ``{"world_size": W, "ranks": [part_0, ...]}``. A part holding per-rank entries
(:func:`holds_per_rank`) loads only on its own rank and world size. A whole job loads into world
size ``W'`` by :func:`share_of`: new rank ``r`` sums old ranks ``r, r + W', ...`` scaled by
``W'/W``, keeping the job's average of every per-rank entry; shared entries come from rank 0.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from commpress.comm.backend import Backend
from commpress.compressors import Compressor
from commpress.config import config_diff
from commpress.errors import ConfigError

__all__ = [
    "DCPState",
    "check_config",
    "check_resume",
    "check_state",
    "combine_compressors",
    "compressors_per_rank",
    "gather_job",
    "holds_per_rank",
    "is_whole_job",
    "own_part",
    "same_everywhere",
    "share_of",
    "sum_entries",
    "tag",
]


def tag(part: dict[str, Any], rank: int | None, world_size: int | None, step: int, config: Mapping[str, Any]) -> dict[str, Any]:
    """``part`` tagged with its rank and world size (None before connecting), step and config."""
    return {"rank": rank, "world_size": world_size, "step": int(step), "config": dict(config), **part}


def gather_job(allgather: Callable[[Any], list[Any]], part: dict[str, Any]) -> dict[str, Any]:
    """The whole job: every rank's ``part`` through ``allgather`` (a collective)."""
    parts = allgather(part)
    return {"world_size": len(parts), "ranks": parts}


class DCPState:
    """``obj`` (a hook state, trainer or FSDP state) as a ``Stateful`` for DCP: each rank's part,
    as ``weights_only`` bytes, under a key of its own, since DCP writes a key every rank holds
    only once (keeping rank 0's error feedback for all)."""

    def __init__(self, obj: Any, rank: int | None = None) -> None:
        self.obj = obj
        self._rank = rank

    @property
    def key(self) -> str:
        if self._rank is None:
            self._rank = dist.get_rank()
        return f"rank{self._rank}"

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.obj.state_dict(), buffer)
        buffer.seek(0)
        return {self.key: buffer}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        buffer = state[self.key]
        buffer.seek(0)
        self.obj.load_state_dict(torch.load(buffer, weights_only=True))


def is_whole_job(state: Mapping[str, Any]) -> bool:
    return "ranks" in state


def own_part(
    state: Mapping[str, Any],
    rank: int,
    world_size: int,
    what: str,
    per_rank: Callable[[Mapping[str, Any]], bool],
    combine: Callable[[Mapping[str, Any], Sequence[Mapping[str, Any]], float], dict[str, Any]],
) -> Mapping[str, Any]:
    """This rank's part of ``state`` (a part, or a whole job). ``per_rank(part)``: whether it
    holds per-rank entries; ``combine(shared, parts, scale)``: a part for another world size."""
    check_state(state, what)
    if not is_whole_job(state):
        _check_whose(state, rank, world_size, what, per_rank)
        return state
    parts = list(state["ranks"])
    if len(parts) != int(state["world_size"]) or not parts:
        raise ValueError(f"{what}: whole-job state lists {len(parts)} ranks but says world_size = {state['world_size']}")
    for r, part in enumerate(parts):
        if int(part["rank"]) != r:
            raise ValueError(f"{what}: whole-job state has rank {part['rank']}'s part in place {r}")
    if len(parts) == world_size:
        return parts[rank]
    mine, scale = share_of(parts, rank, world_size)
    return combine(parts[0], mine, scale)


def same_everywhere(
    state: Mapping[str, Any], rank: int, world_size: int, what: str, config: Mapping[str, Any]
) -> Mapping[str, Any]:
    """:func:`own_part` for state that holds nothing per rank (step counters), config checked."""
    part = own_part(state, rank, world_size, what, lambda _: False, lambda shared, _, __: dict(shared))
    check_config(part["config"], config, what)
    return part


def share_of(parts: Sequence[Any], rank: int, world_size: int) -> tuple[list[Any], float]:
    """The old parts new ``rank`` of ``world_size`` takes over, and their scale."""
    return [p for r, p in enumerate(parts) if r % world_size == rank], world_size / len(parts)


def sum_entries(parts: Sequence[Mapping[str, torch.Tensor]], scale: float) -> dict[str, torch.Tensor]:
    """Name -> ``scale`` times the sum over ``parts`` of that name's tensor (float32)."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, t in part.items():
            value = t.detach().to(torch.float32) * scale
            out[name] = out[name].add_(value) if name in out else value
    return out


def holds_per_rank(entries: Mapping[str, Any], keys: Sequence[str]) -> bool:
    """Whether any of ``keys`` of a compressor's state has an entry."""
    return any(entries.get(key) for key in keys)


def check_state(state: Any, what: str) -> None:
    """Raise ValueError unless ``state`` is a part or a whole job of parts."""
    if not isinstance(state, Mapping):
        _refuse_junk(what, f"is {'None' if state is None else 'a ' + type(state).__name__}")
    if not is_whole_job(state):
        missing = [k for k in ("rank", "world_size", "step", "config") if k not in state]
        if missing:
            _refuse_junk(what, f"has no {', '.join(missing)}")
        return
    ranks = state["ranks"]
    if "world_size" not in state or not isinstance(ranks, (list, tuple)):
        _refuse_junk(what, "has ranks that are not a list of parts with their world_size")
    for part in ranks:
        if not isinstance(part, Mapping) or is_whole_job(part):
            _refuse_junk(what, "lists a rank's part that is not one")
        check_state(part, what)


def _refuse_junk(what: str, found: str) -> None:
    raise ValueError(
        f"{what}: the state {found}: it is not a commpress state dict of this version (save it again with state_dict())"
    )


def _check_whose(part: Mapping[str, Any], rank: int, world_size: int, what: str, per_rank: Callable[..., bool]) -> None:
    saved_rank, saved_world = part["rank"], part["world_size"]
    if (saved_rank, saved_world) == (rank, world_size) or not per_rank(part):
        return
    if saved_world != world_size:
        raise ValueError(
            f"{what}: rank {rank} of {world_size} was given the state of rank {saved_rank} of {saved_world}; its "
            "error feedback differs per rank. To resume with another world size, save the whole job "
            "(state_dict(full=True) on every rank) and load that"
        )
    raise ValueError(
        f"{what}: rank {rank} was given the state of rank {saved_rank}; its error feedback differs per rank. Load "
        f"each rank's own file, or save the whole job with state_dict(full=True) (every rank calls it; rank 0 "
        "may save it alone) and load that on every rank"
    )


def check_config(saved: Mapping[str, Any], current: Mapping[str, Any], what: str) -> None:
    """Raise :class:`ConfigError` naming every setting in which ``saved`` and ``current`` differ."""
    diffs = config_diff(saved, current)
    if diffs:
        raise ConfigError(f"{what}: the state was saved with another config: {'; '.join(diffs)}. Load it with the same config")


def check_resume(backend: Backend, step: int, digest: str, what: str) -> None:
    """Raise on every rank if ranks are about to reduce from different steps or configs."""
    seen = backend.allgather_object((int(step), digest))
    steps = [s for s, _ in seen]
    if len(set(steps)) > 1:
        listed = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
        raise ConfigError(
            f"{what}: ranks resume from different steps ({listed}): every rank must load the state saved at the "
            "same step (one whole-job state, or each rank's file from the same checkpoint)"
        )
    digests = {d for _, d in seen}
    if len(digests) > 1:
        others = [r for r, (_, d) in enumerate(seen) if d != digest]
        raise ConfigError(f"{what}: ranks {others} run another config than rank {backend.rank}: every rank must use the same")


def compressors_per_rank(compressors: Mapping[str, Compressor], states: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether the compressor states (group key -> state) hold per-rank entries."""
    return any(holds_per_rank(states.get(key, {}), c.per_rank_state) for key, c in compressors.items())


def combine_compressors(
    compressors: Mapping[str, Compressor], shared: Mapping[str, Any], parts: Sequence[Mapping[str, Any]], scale: float
) -> dict[str, Any]:
    """Group key -> one rank's compressor state, from old rank 0's and the parts it takes over."""
    out: dict[str, Any] = {}
    for key, c in compressors.items():
        state = dict(shared.get(key, {}))
        for entry in c.per_rank_state:
            if entry in state:
                state[entry] = sum_entries([p.get(key, {}).get(entry, {}) for p in parts], scale)
        out[key] = state
    return out


def check_same_mesh(state: Mapping[str, Any], shard_shapes: list[list[int]], world_size: int, what: str) -> None:
    """Refuse a sharded model's state saved on another mesh (shard shapes, replica groups)."""
    state = state if isinstance(state, Mapping) else {}
    saved = (state.get("config", {}).get("shard_shapes"), state.get("world_size"))
    if saved != (shard_shapes, world_size):
        raise ConfigError(
            f"{what}: the state was saved by a rank holding shards of shapes {saved[0]} in {saved[1]} replica "
            f"groups; this rank holds {shard_shapes} in {world_size}: a sharded model's commpress state does not reshard "
            "(the model and optimizer do, through torch.distributed.checkpoint): resume on the mesh it was saved on"
        )
