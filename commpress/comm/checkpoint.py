"""Per-rank state in checkpoints: each state says whose it is, a whole job's states travel
together, and every rank takes back its own part.

Error feedback, Top-k residuals and DGC's velocities differ per rank. A state dict from
:meth:`state_dict` is one rank's *part*: it records ``rank``, ``world_size``, ``step`` and
the ``config`` it was saved with. A *whole-job* state (``state_dict(full=True)``, a
collective) is ``{"world_size": W, "ranks": [part_0, ..., part_W-1]}``: a rank-0-only
checkpoint holds every rank's part, and each rank loads its own.

A part is refused by another rank, or by a job of another world size, when it holds
per-rank entries (:func:`holds_per_rank`); a part without them (stateless methods, or
before compression started) is the same on every rank and loads anywhere. A whole-job
state loads into a job of another world size by :func:`share_of`: new rank ``r`` takes
the old ranks ``r, r + W', r + 2W', ...``, summed and scaled by ``W'/W``, so the job's
average of every per-rank entry (the gradient it still owes) is kept; shared entries come
from old rank 0. New ranks beyond the old world size start with none.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

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
    """``part`` with the rank, world size, step and config it belongs to. A state not
    connected yet, which has reduced nothing, has rank and world size None: it holds
    nothing per rank and loads on any rank."""
    return {"rank": rank, "world_size": world_size, "step": int(step), "config": dict(config), **part}


def gather_job(allgather: Callable[[Any], list[Any]], part: dict[str, Any]) -> dict[str, Any]:
    """Every rank's ``part``, on every rank, through ``allgather`` (a backend's
    ``allgather_object``: a collective, every rank calls it)."""
    parts = allgather(part)
    return {"world_size": len(parts), "ranks": parts}


class DCPState:
    """``obj`` (a hook state, a Local SGD/CO2 trainer, an FSDP state) as a ``Stateful`` for
    ``torch.distributed.checkpoint``: ``dcp.save({"hook": DCPState(state)}, ...)`` writes
    each rank's own part under a key of its own (DCP writes a key that every rank holds
    only once, which would keep rank 0's error feedback for all), and ``dcp.load`` hands
    each rank its part back, checked like :meth:`load_state_dict`. The part is stored as
    bytes that ``torch.load(..., weights_only=True)`` reads. Resuming with another world
    size needs the whole job (``state_dict(full=True)``)."""

    def __init__(self, obj: Any, rank: int | None = None) -> None:
        self.obj = obj
        self._rank = rank

    @property
    def key(self) -> str:
        if self._rank is None:
            import torch.distributed as dist

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
    """This rank's part of ``state`` (a part, or a whole job).

    ``per_rank(part)`` says whether a part holds entries that differ per rank;
    ``combine(shared, parts, scale)`` builds one rank's part from old rank 0's (``shared``)
    and the old parts it takes over (a whole job saved with another world size).
    """
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
    """This rank's part of the ``state`` of an object that holds nothing per rank (step
    counters): any rank's part will do; the config must be the saved one."""
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
    """Raise ValueError, saying so, unless ``state`` is a part or a whole job of parts:
    whatever else it is (None, a list, another library's dict) gets the one message."""
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
    """Raise on every rank if ranks are about to reduce from different steps or configs
    (states saved at different times, or some ranks resumed and others not)."""
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
    """Group key -> one rank's compressor state, from old rank 0's (``shared``) and the
    old ranks' states it takes over (see :func:`own_part`)."""
    out: dict[str, Any] = {}
    for key, c in compressors.items():
        state = dict(shared.get(key, {}))
        for entry in c.per_rank_state:
            if entry in state:
                state[entry] = sum_entries([p.get(key, {}).get(entry, {}) for p in parts], scale)
        out[key] = state
    return out


def check_same_mesh(state: Mapping[str, Any], shard_shapes: list[list[int]], world_size: int, what: str) -> None:
    """A sharded model's state loads on the mesh it was saved on only: ``shard_shapes`` in
    ``world_size`` replica groups (its rows are this shard's)."""
    config = state.get("config", {}) if isinstance(state, Mapping) else {}
    saved = (config.get("shard_shapes"), state.get("world_size") if isinstance(state, Mapping) else None)
    if saved != (shard_shapes, world_size):
        raise ConfigError(
            f"{what}: the state was saved by a rank holding shards of shapes {saved[0]} in {saved[1]} replica "
            f"groups; this rank holds {shard_shapes} in {world_size}: a sharded model's commpress state does not reshard "
            "(the model and optimizer do, through torch.distributed.checkpoint): resume on the mesh it was saved on"
        )
