"""One call for a whole config: :func:`register` applies every table of one config (a
dict, a ``.toml`` or ``.json`` file, a :class:`~commpress.config.Config`) that applies to
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

The table is :mod:`commpress.config.matrix`'s, which decides it (a test keeps the two
equal). Tables stay the contract of one subsystem each (:mod:`commpress.config.tables`); this
module only applies the part the matrix picks for the model.
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


class Registration:
    """What :func:`register` applied to a model: its :attr:`parts`
    (:class:`~commpress.parts.AppliedPart`), each reachable by its name, None where that
    part does not apply: ``hook``, the DDP hook's :class:`~commpress.hooks.CommState`;
    ``local_sgd``, the :class:`~commpress.local_sgd.LocalSGD`,
    :class:`~commpress.local_sgd.CO2` or :class:`~commpress.local_sgd.DiLoCo` trainer run
    by the optimizer's step hooks; ``onebit_adam``, the :class:`~commpress.optim.OneBitAdam`
    on the user's AdamW; ``dion``, the :class:`~commpress.optim.Dion` in place of Muon's
    step; ``fsdp``, the FSDP state (:class:`~commpress.fsdp.FSDP2State` or
    :class:`~commpress.fsdp.QuantizedState`); ``groups_hook``, the cross-group hook. No
    part applies in a single process.

    :meth:`remove` (or leaving a ``with commpress.register(...) as reg:`` block) takes
    every hook it added off the model and the optimizer.

    Checkpoints: :meth:`state_dict` holds each applied part's state under its name
    (``"ddp_hook"``, ``"local_sgd"``, ``"onebit_adam"``, ``"dion"``, ``"fsdp"``,
    ``"groups_hook"``); ``full=True`` gathers every rank's parts
    (a collective: call it on every rank) for a checkpoint saved on rank 0 only, and
    :meth:`load_state_dict` hands each part its own, as the parts do
    (:mod:`commpress.comm.checkpoint`). With torch.distributed.checkpoint, save
    :meth:`stateful` (this state and the model's, each under the rank or replica it belongs to).
    """

    def __init__(self, config: Config, parts: Sequence[AppliedPart] = ()) -> None:
        self.config = config
        #: the applied parts, in the order they were applied
        self.parts: tuple[AppliedPart, ...] = tuple(parts)

    def _target(self, name: str) -> Any:
        return next((p.target for p in self.parts if p.name == name), None)

    @property
    def hook(self) -> CommState | None:
        return self._target("ddp_hook")

    @property
    def local_sgd(self) -> LocalSGD | None:
        return self._target("local_sgd")

    @property
    def onebit_adam(self) -> OneBitAdam | None:
        return self._target("onebit_adam")

    @property
    def dion(self) -> Dion | None:
        return self._target("dion")

    @property
    def fsdp(self) -> FSDP2State | QuantizedState | None:
        return self._target("fsdp")

    @property
    def groups_hook(self) -> CrossGroupHook | None:
        return self._target("groups_hook")

    @property
    def traffic(self) -> Traffic:
        """What this rank sent through commpress (:class:`~commpress.comm.Traffic`): the
        DDP hook's, the averaging's (every outer sync), or FSDP's; for FSDP2 both sides summed when read;
        zero where nothing applies."""
        return self.parts[0].traffic if self.parts else Traffic()

    @property
    def plan(self) -> LayerPlan | None:
        """The DDP hook's ``[layerwise]`` plan in force (each tensor's setting and bytes; under
        the bandwidth layer, this rank's cross group's), or None (no plan yet, no
        ``[layerwise]`` table, no hook)."""
        return self.hook.plan if self.hook is not None else None

    def finish(self) -> None:
        """End of training: Local SGD averages the steps since its last round, CO2 waits
        for its last average and applies it, DiLoCo lands its fragments in flight and syncs
        every fragment changed since (every rank ends with the same model). The other parts
        have nothing left to do."""
        for part in self.parts:
            part.finish()

    def averaged(self) -> contextlib.AbstractContextManager[None]:
        """A block in which the model holds the job's model, the same on every rank, to
        evaluate or save mid-run (on rank 0 alone if you like: no collective): under
        ``[local_sgd]`` the model at its last sync (:meth:`LocalSGD.averaged`), this rank's
        own parameters put back after the block; with every other part each rank already
        holds it."""
        return _averaged(self.parts)

    def remove(self) -> None:
        """Take every hook :func:`register` added off the model and the optimizer: DDP
        all-reduces gradients (and, after Local SGD, syncs buffers if it was built to) as
        it does without a comm hook, ``optimizer.step()`` is the optimizer's own step
        (DGC's momentum given back to it), and nothing more goes through commpress. Local
        SGD leaves each rank's model where it is: call :meth:`finish` first for one model
        on every rank. The FSDP part is not removable."""
        if not all(p.removable for p in self.parts):
            raise RuntimeError("Registration.remove(): the hooks of a sharded model's collectives cannot be taken off")
        for part in self.parts:
            part.remove()

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """Each applied part's state under its name; ``full=True``: every rank's (a
        collective, see :meth:`commpress.CommState.state_dict`)."""
        return {part.name: part.state_dict(full=full) for part in self.parts}

    def stateful(self, model: torch.nn.Module, optimizer: Any = None) -> ReplicaState:
        """This registration's state with ``model``'s and ``optimizer``'s, as
        torch.distributed.checkpoint must save them (a ``Stateful``,
        :class:`~commpress.replica_state.ReplicaState`): every rank's :meth:`state_dict`
        under its rank, the model and optimizer under their replica's key (``[local_sgd]``'s
        replicas differ between syncs): ``dcp.save({"train": reg.stateful(model, opt)})``,
        then ``dcp.load`` the same to resume."""
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
    """Apply every table of ``config`` that applies to ``model`` (the module docstring's
    table), on every rank, after wrapping or sharding the model and before the first
    backward.

    ``optimizer``: the model's optimizer, or a list of several over disjoint parameters
    (Muon and AdamW: a :class:`~commpress.optim.HybridOptimizer`, whose iteration ends when
    each has stepped). With ``[local_sgd]`` it is required: its
    ``step()`` then runs the rounds (the training loop stays ``loss.backward();
    optimizer.step()``; call :meth:`Registration.finish` at the end). For the DDP hook,
    methods that apply momentum themselves (Top-k with ``dgc = true``) take it over from
    the optimizer's SGD groups. ``process_group``: the group the DDP hook or Local SGD
    communicates in (default: the model's, or the world; FSDP uses its own mesh).
    ``total_steps``: lets QSR cap the last round. ``manager``: a ``torchft.Manager`` every
    collective goes through (docs/fault_tolerance.md): the DDP hook's (the model wrapped by
    :func:`commpress.hooks.managed_ddp`), 1-bit Adam's, Dion's, or the syncs of ``[local_sgd]``. ``mesh``:
    the 2-D ``DeviceMesh`` (``"replicate"``, ``"shard"``) of a model sharded with FSDP2 over
    ``mesh["shard"]`` inside each replica group (:mod:`commpress.comm.mesh`): ``[local_sgd]``
    then averages each rank's shard over the groups, and a config without it averages
    each gradient shard over the groups every step (the cross-group hook).
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


@contextlib.contextmanager
def _averaged(parts: Sequence[AppliedPart]) -> Iterator[None]:
    """Every part's :meth:`~commpress.parts.AppliedPart.averaged` block, entered at ``with``."""
    with contextlib.ExitStack() as stack:
        for part in parts:
            stack.enter_context(part.averaged())
        yield
