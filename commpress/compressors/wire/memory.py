"""Error-feedback memory: a compressor's per-parameter state, keyed by name, changed in whole steps.

State lives with the parameter, not the bucket, since DDP regroups parameters into new buckets;
a bucket gathers its parameters' entries wherever they are. A step's changes are staged until
:meth:`ErrorMemory.commit`, so a step the optimizer skips leaves no trace.

An entry is a view of the flat buffer it was staged from; when a bucket's entries still lie at
their offsets in one buffer (the usual case), that buffer is returned without a copy.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from commpress.compressors import host

__all__ = ["ErrorMemory", "MemoryState", "Piece"]

#: Where a parameter's entry sits in a flat buffer: (name, offset, shape).
Piece = tuple[str, int, tuple[int, ...]]


@dataclass(frozen=True)
class _Entry:
    base: torch.Tensor  # flat float32
    offset: int
    shape: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        return self.base.narrow(0, self.offset, math.prod(self.shape)).view(self.shape)


class ErrorMemory:
    """Float32 tensors of a few kinds ("error", "q", ...), per name; reads see committed state only."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._staged: dict[tuple[str, str], _Entry] = {}
        self._bases: set[int] = set()  # ids of the buffers entries view (committed or staged)
        # per key (a bucket layout), the buffers a compressor's new state alternates between
        self._spares: dict[tuple, list[torch.Tensor]] = {}

    # ---- reads -------------------------------------------------------------------------

    def gather(
        self,
        kind: str,
        pieces: Sequence[Piece],
        numel: int,
        device: torch.device,
        fill: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[str]]:
        """A flat float32 buffer holding each piece's committed ``kind`` entry at its offset, and the
        names of pieces with none of that shape (those hold ``fill()``'s values, default zeros). The
        buffer may be committed state itself (:meth:`holds`): read it, never write it."""
        found = [self._entries.get((kind, name)) for name, _, _ in pieces]
        first = found[0] if found else None
        if (
            first is not None
            and first.base.device == device
            and first.base.numel() >= numel
            and all(
                e is not None and e.base is first.base and e.offset == offset and e.shape == tuple(shape)
                for e, (_, offset, shape) in zip(found, pieces)
            )
        ):
            return first.base, []
        out = fill() if fill is not None else torch.zeros(numel, dtype=torch.float32, device=device)
        missing = []
        for entry, (name, offset, shape) in zip(found, pieces):
            if entry is None or entry.shape != tuple(shape):
                missing.append(name)
                continue
            src = entry.tensor()
            if src.device != device:
                src = host.to_device(src, device)
            out.narrow(0, offset, src.numel()).copy_(src.reshape(-1))
        return out, missing

    def holds(self, buffer: torch.Tensor) -> bool:
        """Whether an entry may view ``buffer`` (then it must not be reused); conservative until the step ends."""
        return id(buffer) in self._bases

    def spare(self, key: tuple, numel: int, device: torch.device) -> torch.Tensor:
        """A float32 buffer no entry views, for the state a step stages; two per ``key`` (bucket layout)
        are reused, committed and staged, saving an allocation every step."""
        buffers = self._spares.setdefault(key, [])
        free = next((b for b in buffers if not self.holds(b)), None)
        if free is None:
            free = torch.empty(numel, dtype=torch.float32, device=device)
            if len(buffers) < 2:
                buffers.append(free)
        return free

    def residuals(self, pieces: Sequence[Piece], grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Error feedback's buffers in ``grad``'s layout: the committed "residual" entries (read only)
        and a :meth:`spare` for the new residuals, which the step fills and stages."""
        n = grad.numel()
        residual, _ = self.gather("residual", pieces, n, grad.device)
        return residual.narrow(0, 0, n), self.spare((tuple(pieces), n, grad.device), n, grad.device)

    # ---- staged changes ------------------------------------------------------------------

    def stage(self, kind: str, pieces: Sequence[Piece], flat: torch.Tensor) -> None:
        """Make each piece of float32 ``flat`` the ``kind`` entry of its name, at the next commit."""
        for name, offset, shape in pieces:
            self._staged[kind, name] = _Entry(flat, offset, tuple(shape))
        self._bases.add(id(flat))

    @property
    def staged(self) -> bool:
        """Whether changes wait for :meth:`commit` or :meth:`discard`."""
        return bool(self._staged)

    def commit(self) -> None:
        """Apply the staged changes."""
        self._entries.update(self._staged)
        self.discard()

    def discard(self) -> None:
        """Drop the staged changes."""
        self._staged.clear()
        self._bases = {id(e.base) for e in self._entries.values()}

    # ---- checkpoints ---------------------------------------------------------------------

    def tensors(self, kind: str) -> dict[str, torch.Tensor]:
        """CPU copies of the committed ``kind`` entries, by name, shaped as staged."""
        return {name: host.to_host(e.tensor()) for (k, name), e in self._entries.items() if k == kind}

    def load(self, kind: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Add ``kind`` entries (copied as float32; moved to a gradient's device at first use)."""
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"saved {kind!r} state of {name!r} must be a tensor, got {type(t).__name__}")
            flat = t.detach().to(torch.float32, copy=True).reshape(-1)
            self._entries[kind, str(name)] = _Entry(flat, 0, tuple(t.shape))
            self._bases.add(id(flat))

    def clear(self) -> None:
        """Forget everything, staged changes included."""
        self._entries.clear()
        self.discard()


class MemoryState:
    """A compressor's steps and checkpoints when its state is an :class:`ErrorMemory` (``_memory``);
    mixed in before :class:`~commpress.compressors.base.Compressor`."""

    name: str
    _memory: ErrorMemory

    @abstractmethod
    def _kinds(self) -> dict[str, str]:
        """state_dict key -> memory kind."""

    def end_step(self, commit: bool) -> None:
        """Apply (``commit``) or drop the state the step staged."""
        if commit:
            self._memory.commit()
        else:
            self._memory.discard()

    def state_dict(self) -> dict[str, Any]:
        """Each key of :meth:`_kinds`: its kind's committed entries by parameter name."""
        return {key: self._memory.tensors(kind) for key, kind in self._kinds().items()}

    def owed(self, entries: Mapping[str, Any]) -> torch.Tensor | None:
        """With error feedback, the residual (state key "residuals")."""
        return entries.get("residuals")

    def _owner(self) -> str:
        """Who refuses a state with other keys."""
        return f"compressor {self.name!r}"

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; buckets pick the entries up by parameter name at first use."""
        kinds = self._kinds()
        if set(state) != set(kinds):
            raise ValueError(f"{self._owner()} expects state with keys {sorted(kinds)}, got keys {sorted(state)}")
        self._memory.clear()
        for key, kind in kinds.items():
            self._memory.load(kind, state[key])
