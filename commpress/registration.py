"""One call for a whole config: :func:`register` applies every table of a config that applies to
the model it is handed, and refuses, saying why, each one that cannot:

============================================  ============================================
model                                         what applies
============================================  ============================================
DistributedDataParallel model                 the DDP hook, with method, overrides,
                                              start_iter, backend = 'mpi', [bandwidth],
                                              [layerwise]; [local_sgd] instead, with
                                              method, backend = 'mpi'; [onebit_adam]
                                              instead, with method, backend = 'mpi';
                                              [dion] instead, with method; [layerwise]
                                              needs method; backend = 'mpi' and
                                              [bandwidth] do not combine
model sharded with fully_shard (FSDP2)        [fsdp] (required) alone
model sharded with fully_shard inside         the cross-group hook, with method;
replica groups (register(..., mesh=) with a   [local_sgd] instead, with method
2-D mesh)
FSDP1 root (FullyShardedDataParallel)         [fsdp] (required) alone
plain module (neither                         [local_sgd] (required), with method, backend
DistributedDataParallel nor sharded) in a     = 'mpi'
job of several processes
DistributedDataParallel model, under a        the DDP hook, with method, overrides,
torchft Manager                               start_iter, [layerwise]; [local_sgd]
                                              instead, with method; [onebit_adam] instead,
                                              with method; [dion] instead, with method
model sharded with fully_shard (FSDP2),       [local_sgd] (required), with method
under a torchft Manager
plain module (neither                         [local_sgd] (required), with method
DistributedDataParallel nor sharded) in a
job of several processes, under a torchft
Manager
single process (torch.distributed not         nothing; a config that applies to no model
initialized)                                  is refused
============================================  ============================================

:mod:`commpress.config.matrix` decides it; this module applies the part it picks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from commpress.comm import Traffic
from commpress.config import Config
from commpress.config.matrix import model_kind, part_for
from commpress.errors import ConfigError
from commpress.fsdp import FSDP2State, QuantizedState
from commpress.fsdp.groups import CrossGroupHook
from commpress.hooks import CommState
from commpress.layerwise.plan import LayerPlan
from commpress.local_sgd import LocalSGD
from commpress.optim import Dion, OneBitAdam
from commpress.optim.hybrid import as_optimizer
from commpress.parts import PART_TYPES, AppliedPart, Request
from commpress.replica_state import ReplicaState

__all__ = ["Registration", "register"]


def _part(name: str) -> Any:
    """A read-only attribute: the target of the applied part called ``name``, None where none is."""
    return property(lambda reg: next((p.target for p in reg.parts if p.name == name), None))


class Registration:
    """What :func:`register` applied to a model: its :attr:`parts`, each reachable by its name
    (``hook``, the DDP hook's :class:`~commpress.hooks.CommState`; ``local_sgd``, ``onebit_adam``,
    ``dion``, ``fsdp``, ``groups_hook``), None where it does not apply. Leaving a ``with
    commpress.register(...) as reg:`` block calls :meth:`remove`."""

    def __init__(self, config: Config, parts: Sequence[AppliedPart] = ()) -> None:
        self.config = config
        #: the applied parts, in the order they were applied
        self.parts: tuple[AppliedPart, ...] = tuple(parts)

    hook: CommState | None = _part("ddp_hook")
    local_sgd: LocalSGD | None = _part("local_sgd")
    onebit_adam: OneBitAdam | None = _part("onebit_adam")
    dion: Dion | None = _part("dion")
    fsdp: FSDP2State | QuantizedState | None = _part("fsdp")
    groups_hook: CrossGroupHook | None = _part("groups_hook")

    @property
    def traffic(self) -> Traffic:
        """What this rank sent through commpress (zero where nothing applies)."""
        return self.parts[0].traffic if self.parts else Traffic()

    @property
    def plan(self) -> LayerPlan | None:
        """The DDP hook's ``[layerwise]`` plan in force (this rank's cross group's), or None."""
        return self.hook.plan if self.hook is not None else None

    def finish(self) -> None:
        """End of training: the Local SGD family averages what is still pending, so every rank ends
        with the same model; the other parts have nothing left to do."""
        for part in self.parts:
            part.finish()

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """A block in which the model holds the job's model, the same on every rank, to evaluate or
        save mid-run (under ``[local_sgd]``: the model at its last sync, this rank's own restored after)."""
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.averaged())
            yield

    def remove(self) -> None:
        """Take every hook :func:`register` added off the model and the optimizer (RuntimeError for a
        sharded model's); Local SGD leaves each rank's model as it is (call :meth:`finish` first)."""
        if not all(p.removable for p in self.parts):
            raise RuntimeError("Registration.remove(): the hooks of a sharded model's collectives cannot be taken off")
        for part in self.parts:
            part.remove()

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """Each applied part's state under its name; ``full=True``: every rank's (a collective)."""
        return {part.name: part.state_dict(full=full) for part in self.parts}

    def stateful(self, model: torch.nn.Module, optimizer: Any = None) -> ReplicaState:
        """This registration's, ``model``'s and ``optimizer``'s state as torch.distributed.checkpoint
        must save them: ``dcp.save({"train": reg.stateful(model, opt)})``, ``dcp.load`` to resume."""
        return ReplicaState(self, model, as_optimizer(optimizer))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (this rank's parts or the whole job's), part by part."""
        names = [part.name for part in self.parts]
        if not isinstance(state, Mapping) or set(state) != set(names):
            held = f"holds {', '.join(sorted(map(str, state))) or 'nothing'}" if isinstance(state, Mapping) else "is not a dict"
            raise ConfigError(
                f"the state {held}; this registration applies "
                f"{', '.join(names) or 'nothing'}: load a state saved by a registration of the same config and kind "
                "of model (DDP, sharded, plain)"
            )
        for part in self.parts:
            part.load_state_dict(state[part.name])

    def __repr__(self) -> str:
        names = ", ".join(part.name for part in self.parts)
        return f"Registration({names or 'nothing applied'}; method={self.config.method!r})"


def register(
    model: torch.nn.Module,
    config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    process_group: Any = None,
    total_steps: int | None = None,
    manager: Any = None,
    mesh: Any = None,
) -> Registration:
    """Apply every table of ``config`` that applies to ``model`` (the module docstring's table), on
    every rank, after wrapping or sharding the model and before the first backward.

    ``optimizer``: the model's optimizer, or a list over disjoint parameters (Muon and AdamW, as a
    :class:`~commpress.optim.HybridOptimizer`); ``[local_sgd]`` runs at its ``step()`` (call
    :meth:`Registration.finish` at the end), DGC takes over its SGD momentum. ``process_group``:
    the group the DDP hook or Local SGD talks in (default: the model's, or the world).
    ``total_steps``: the run's length (QSR's last round, a fractional ``[onebit_adam]`` warmup).
    ``manager``: a ``torchft.Manager`` every collective goes through (docs/fault_tolerance.md;
    wrap a DDP model with :func:`commpress.hooks.managed_ddp`). ``mesh``: the 2-D ``DeviceMesh``
    (``"replicate"``, ``"shard"``) of a model sharded over ``mesh["shard"]`` in each replica group.
    """
    cfg = Config.load(config)
    if mesh is not None and (manager is not None or process_group is not None):
        given = "manager" if manager is not None else "process_group"
        instead = (
            "with a torchft Manager, pass the model sharded over its replica group's ranks and no mesh: the "
            "manager joins the groups"
            if manager is not None
            else "the replica groups of mesh['replicate'] communicate through torch.distributed"
        )
        raise ConfigError(f"commpress.register(): {given} is not accepted with mesh=; expected neither: {instead}")
    request = Request(as_optimizer(optimizer), process_group, total_steps, manager, mesh)
    managed = manager is not None
    part = part_for(cfg, model_kind(model, cfg.backend, mesh, managed), managed=managed)
    if part is None:
        return Registration(cfg)  # a single process: nobody to send to, nothing to apply
    return Registration(cfg, [PART_TYPES[part.name].build(model, cfg, request)])
