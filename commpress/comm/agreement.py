"""Every rank agrees on the config before any collective whose shape depends on it.

Ranks with different configs would build different communicators or collectives and hang in
the transport; one digest exchange, bounded by the group's timeout, fails them all instead.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from commpress.comm.torch_backend import allgather_object, require_initialized
from commpress.config import Config, digest_of
from commpress.errors import CollectiveError, ConfigError

__all__ = ["agree_on_config", "agree_on_digest", "agree_on_settings"]


def agree_on_config(config: Config, entry: str, backend: str = "torch", process_group: Any = None) -> None:
    """Raise :class:`ConfigError` on every rank if ``config`` differs across ranks."""
    agree_on_digest(config.digest(), entry, backend, process_group, detail=config.to_dict())


def agree_on_settings(settings: Any, entry: str, backend: str = "torch", process_group: Any = None, detail: Any = None) -> None:
    """:func:`agree_on_digest` of plain-data ``settings``; ``detail`` (default: ``settings``) is shown."""
    agree_on_digest(digest_of(settings), entry, backend, process_group, settings if detail is None else detail)


def agree_on_digest(digest: str, entry: str, backend: str = "torch", process_group: Any = None, detail: Any = None) -> None:
    """Raise :class:`ConfigError` on every rank if ``digest`` differs (:class:`CollectiveError` if a
    rank never joins); torch.distributed first even for ``"mpi"``, to catch a rank on the other."""
    if backend == "mpi" and not (dist.is_available() and dist.is_initialized()):
        from mpi4py import MPI

        comm = process_group if process_group is not None else MPI.COMM_WORLD
        digests, rank = comm.allgather(digest), comm.Get_rank()
    else:
        require_initialized(entry)
        group = process_group if process_group is not None and backend == "torch" else dist.group.WORLD
        try:
            digests = allgather_object(digest, group)
        except RuntimeError as exc:
            raise CollectiveError(
                f"{entry}: comparing the commpress config across ranks failed (a rank that never builds it, "
                f"or a dead peer?): {exc}"
            ) from exc
        rank = dist.get_rank(group)
    if len(set(digests)) > 1:
        others = [r for r, d in enumerate(digests) if d != digest]
        raise ConfigError(
            f"{entry}: commpress config differs across ranks (rank {rank} has {digest}, ranks {others} differ): "
            f"every rank must use the same config; this rank's is {detail if detail is not None else digest}"
        )
