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
                                              [layerwise] needs method; backend = 'mpi'
                                              and [bandwidth] do not combine
model sharded with fully_shard (FSDP2)        [fsdp] (required) alone
model sharded with fully_shard inside         the cross-group hook, with method;
replica groups (register(..., mesh=) with a   [local_sgd] instead, with method
2-D mesh)
FSDP1 root (FullyShardedDataParallel)         [fsdp] (required) alone
plain module (neither                         [local_sgd] (required), with method, backend
DistributedDataParallel nor sharded) in a     = 'mpi'
job of several processes
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
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from commpress.adaptive.layer_plan import LayerPlan
from commpress.comm import Traffic
from commpress.comm.averager import ParameterAverager
from commpress.comm.mesh import replica_groups
from commpress.config import Config
from commpress.config.matrix import model_kind, part_for
from commpress.errors import ConfigError
from commpress.fsdp import FSDP2State, QuantizedState, apply
from commpress.fsdp.groups import CrossGroupHook
from commpress.hooks import CommState
from commpress.hooks.ddp import attach_ddp_hook
from commpress.local_sgd import LocalSGD, from_config
from commpress.local_sgd.warm import load_trainer_kernels
from commpress.optim import ManagedOneBitAdam, OneBitAdam, check_adam
from commpress.replica_state import ReplicaState

__all__ = ["Registration", "register"]


class Registration:
    """What :func:`register` applied to a model, one attribute per part (None where that
    part does not apply): ``hook``, the DDP hook's :class:`~commpress.hooks.CommState`;
    ``local_sgd``, the :class:`~commpress.local_sgd.LocalSGD`,
    :class:`~commpress.local_sgd.CO2` or :class:`~commpress.local_sgd.DiLoCo` trainer run
    by the optimizer's step hooks; ``onebit_adam``, the :class:`~commpress.optim.OneBitAdam`
    on the user's AdamW; ``fsdp``,
    the FSDP state (:class:`~commpress.fsdp.FSDP2State` or
    :class:`~commpress.fsdp.QuantizedState`). No part applies in a single process.

    :meth:`remove` (or leaving a ``with commpress.register(...) as reg:`` block) takes
    every hook it added off the model and the optimizer.

    Checkpoints: :meth:`state_dict` holds each applied part's state under its name
    (``"ddp_hook"``, ``"local_sgd"``, ``"onebit_adam"``, ``"fsdp"``, ``"groups_hook"``); ``full=True`` gathers every rank's parts
    (a collective: call it on every rank) for a checkpoint saved on rank 0 only, and
    :meth:`load_state_dict` hands each part its own, as the parts do
    (:mod:`commpress.comm.checkpoint`). With torch.distributed.checkpoint, save
    :meth:`stateful` (this state and the model's, each under the rank or replica it belongs to).
    """

    def __init__(
        self,
        config: Config,
        *,
        hook: CommState | None = None,
        local_sgd: LocalSGD | None = None,
        onebit_adam: OneBitAdam | ManagedOneBitAdam | None = None,
        fsdp: FSDP2State | QuantizedState | None = None,
        groups_hook: CrossGroupHook | None = None,
        remove_hook: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.hook = hook
        self._remove_hook = remove_hook  # takes the DDP hook off
        self.local_sgd = local_sgd
        self.onebit_adam = onebit_adam
        self.fsdp = fsdp
        self.groups_hook = groups_hook

    def parts(self) -> dict[str, Any]:
        """The applied parts by name, as :meth:`state_dict` keys them."""
        named = (
            ("ddp_hook", self.hook),
            ("local_sgd", self.local_sgd),
            ("onebit_adam", self.onebit_adam),
            ("fsdp", self.fsdp),
            ("groups_hook", self.groups_hook),
        )
        return {name: part for name, part in named if part is not None}

    @property
    def traffic(self) -> Traffic:
        """What this rank sent through commpress (:class:`~commpress.comm.Traffic`): the
        DDP hook's, the averaging's (every outer sync), or FSDP's; for FSDP2 both sides summed when read;
        zero where nothing applies."""
        if self.hook is not None:
            return self.hook.traffic
        if self.local_sgd is not None:
            return self.local_sgd.traffic
        if self.onebit_adam is not None:
            return self.onebit_adam.traffic
        if self.groups_hook is not None:
            return self.groups_hook.traffic
        if isinstance(self.fsdp, FSDP2State):
            sides = self.fsdp.traffic().values()
            return Traffic(
                bytes_sent=int(sum(s["bytes_sent"] for s in sides)),
                collectives=int(sum(s["collectives"] for s in sides)),
                compute_seconds=sum(s["compute_seconds"] for s in sides),
            )
        if self.fsdp is not None:
            return self.fsdp.traffic
        return Traffic()

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
        if self.local_sgd is not None:
            self.local_sgd.finish()

    def averaged(self) -> contextlib.AbstractContextManager[None]:
        """A block in which the model holds the job's model, the same on every rank, to
        evaluate or save mid-run (on rank 0 alone if you like: no collective): under
        ``[local_sgd]`` the model at its last sync (:meth:`LocalSGD.averaged`), this rank's
        own parameters put back after the block; with every other part each rank already
        holds it."""
        return self.local_sgd.averaged() if self.local_sgd is not None else contextlib.nullcontext()

    def remove(self) -> None:
        """Take every hook :func:`register` added off the model and the optimizer: DDP
        all-reduces gradients (and, after Local SGD, syncs buffers if it was built to) as
        it does without a comm hook, ``optimizer.step()`` is the optimizer's own step
        (DGC's momentum given back to it), and nothing more goes through commpress. Local
        SGD leaves each rank's model where it is: call :meth:`finish` first for one model
        on every rank. The FSDP part is not removable."""
        if self.fsdp is not None or self.groups_hook is not None:
            raise RuntimeError("Registration.remove(): the hooks of a sharded model's collectives cannot be taken off")
        if self._remove_hook is not None:
            self._remove_hook()
            self._remove_hook = None
        if self.local_sgd is not None:
            self.local_sgd.remove_hooks()
        if self.onebit_adam is not None:
            self.onebit_adam.detach()

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """Each applied part's state under its name; ``full=True``: every rank's (a
        collective, see :meth:`commpress.CommState.state_dict`)."""
        return {name: part.state_dict(full=full) for name, part in self.parts().items()}

    def stateful(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ReplicaState:
        """This registration's state with ``model``'s and ``optimizer``'s, as
        torch.distributed.checkpoint must save them (a ``Stateful``,
        :class:`~commpress.replica_state.ReplicaState`): every rank's :meth:`state_dict`
        under its rank, the model and optimizer under their replica's key (``[local_sgd]``'s
        replicas differ between syncs): ``dcp.save({"train": reg.stateful(model, opt)})``,
        then ``dcp.load`` the same to resume."""
        return ReplicaState(self, model, optimizer)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (this rank's parts or the whole job's), part by part."""
        parts = self.parts()
        if not isinstance(state, Mapping) or set(state) != set(parts):
            held = f"holds {', '.join(sorted(map(str, state))) or 'nothing'}" if isinstance(state, Mapping) else "is not a dict"
            raise ConfigError(
                f"the state {held}; this registration applies "
                f"{', '.join(parts) or 'nothing'}: load a state saved by a registration of the same config and kind "
                "of model (DDP, sharded, plain)"
            )
        for name, part in parts.items():
            part.load_state_dict(state[name])

    def __repr__(self) -> str:
        return f"Registration({', '.join(self.parts()) or 'nothing applied'}; method={self.config.method!r})"


def register(
    model: torch.nn.Module,
    config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    process_group: Any = None,
    total_steps: int | None = None,
    manager: Any = None,
    mesh: Any = None,
) -> Registration:
    """Apply every table of ``config`` that applies to ``model`` (the module docstring's
    table), on every rank, after wrapping or sharding the model and before the first
    backward.

    ``optimizer``: the model's optimizer. With ``[local_sgd]`` it is required: its
    ``step()`` then runs the rounds (the training loop stays ``loss.backward();
    optimizer.step()``; call :meth:`Registration.finish` at the end). For the DDP hook,
    methods that apply momentum themselves (Top-k with ``dgc = true``) take it over from
    the optimizer's SGD groups. ``process_group``: the group the DDP hook or Local SGD
    communicates in (default: the model's, or the world; FSDP uses its own mesh).
    ``total_steps``: lets QSR cap the last round. ``manager``: a ``torchft.Manager`` every
    collective goes through (docs/fault_tolerance.md): the DDP hook's (the model wrapped by
    :func:`commpress.hooks.managed_ddp`), 1-bit Adam's, or the syncs of ``[local_sgd]``. ``mesh``:
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
    if manager is not None:
        _check_sharded_under_manager(model, cfg)
        if cfg.section("local_sgd") is not None:
            return Registration(cfg, local_sgd=_managed_diloco(model, cfg, optimizer, manager, total_steps))
        if cfg.section("onebit_adam") is not None:
            return Registration(cfg, onebit_adam=_managed_onebit_adam(model, cfg, optimizer, manager, total_steps))
        state, remove = attach_ddp_hook(model, cfg, process_group, optimizer, manager)
        return Registration(cfg, hook=state, remove_hook=remove)
    part = part_for(cfg, model_kind(model, cfg.backend, mesh))
    if part is None:
        return Registration(cfg)  # a single process: nobody to send to, nothing to apply
    if part.name == "groups_hook":
        return Registration(cfg, groups_hook=CrossGroupHook(model, replica_groups(mesh, model), cfg.method, cfg.params))
    if part.name == "fsdp":
        return Registration(cfg, fsdp=apply(model, cfg.section("fsdp")))
    if part.name == "local_sgd":
        return Registration(cfg, local_sgd=_local_sgd(model, cfg, optimizer, process_group, total_steps, mesh))
    if part.name == "onebit_adam":
        return Registration(cfg, onebit_adam=_onebit_adam(model, cfg, optimizer, process_group, total_steps))
    state, remove = attach_ddp_hook(model, cfg, process_group, optimizer)
    return Registration(cfg, hook=state, remove_hook=remove)


def _check_sharded_under_manager(model: torch.nn.Module, cfg: Config) -> None:
    """Under a torchft Manager a sharded model is an FSDP2 model inside each replica group,
    and what joins the groups is ``[local_sgd]`` (each rank syncing its shard)."""
    kind = model_kind(model)
    if kind == "FSDP1" or (kind == "FSDP2" and cfg.section("local_sgd") is None):
        got = "an FSDP1 root" if kind == "FSDP1" else "an FSDP2 model and a config without [local_sgd]"
        raise ConfigError(
            "commpress.register(): under a torchft Manager a sharded model is sharded with fully_shard (FSDP2) "
            "inside its replica group and runs a config with [local_sgd] (DiLoCo between the groups, each rank "
            f"syncing its shard: docs/fault_tolerance.md); got {got}"
        )


def _local_sgd(
    model: torch.nn.Module,
    cfg: Config,
    optimizer: torch.optim.Optimizer | None,
    process_group: Any,
    total_steps: int | None,
    mesh: Any = None,
) -> LocalSGD:
    """The Local SGD / CO2 / DiLoCo trainer of ``[local_sgd]``, run by ``optimizer``'s step hooks."""
    if optimizer is None:
        raise TypeError("the config's [local_sgd] table runs at the optimizer's step: pass register(..., optimizer=optimizer)")
    # torch.optim.Optimizer.__init__ makes the hook tables; a wrapper that skips it lacks them
    if not hasattr(optimizer, "_optimizer_step_post_hooks"):
        raise TypeError(
            f"the config's [local_sgd] table runs at the optimizer's step hooks, which this {type(optimizer).__name__} "
            "does not hold (a wrapper: Accelerate's AcceleratedOptimizer, for one): pass the torch.optim optimizer "
            "it wraps (optimizer.optimizer)"
        )
    trainer = from_config(model, optimizer, cfg, total_steps=total_steps, process_group=process_group, mesh=mesh)
    load_trainer_kernels(trainer)  # the averaging's kernels loaded now, not inside the first sync
    trainer.register_optimizer_hooks()
    return trainer


def _managed_diloco(
    model: torch.nn.Module, cfg: Config, optimizer: torch.optim.Optimizer | None, manager: Any, total_steps: int | None
) -> LocalSGD:
    """The Local SGD / CO2 / DiLoCo trainer of ``[local_sgd]`` whose syncs go through the torchft ``manager``."""
    from commpress.hooks.manager import check_managed
    from commpress.local_sgd.managed import managed_from_config

    if optimizer is None:
        raise TypeError("the config's [local_sgd] table runs at the optimizer's step: pass register(..., optimizer=optimizer)")
    check_managed(cfg)
    trainer = managed_from_config(model, optimizer, cfg, manager, total_steps)
    trainer.register_optimizer_hooks()
    return trainer


def _managed_onebit_adam(
    model: torch.nn.Module, cfg: Config, optimizer: torch.optim.Optimizer | None, manager: Any, total_steps: int | None
) -> ManagedOneBitAdam:
    """1-bit Adam of ``[onebit_adam]`` whose averages go through the torchft ``manager``."""
    from commpress.hooks.manager import check_managed

    if optimizer is None:
        raise TypeError("the config's [onebit_adam] table takes over AdamW's step: pass register(..., optimizer=adamw)")
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"[onebit_adam] under a torchft Manager runs under managed_ddp(module); got {type(model).__name__}")
    check_managed(cfg)
    warmup = cfg.section("onebit_adam").warmup_steps(total_steps)
    onebit = ManagedOneBitAdam(optimizer, model, manager, warmup, cfg.method, cfg.params)
    onebit.attach(model)
    return onebit


def _onebit_adam(
    model: DistributedDataParallel,
    cfg: Config,
    optimizer: torch.optim.Optimizer | None,
    process_group: Any,
    total_steps: int | None,
) -> OneBitAdam:
    """1-bit Adam of ``[onebit_adam]`` on the DDP ``model`` and its AdamW ``optimizer``."""
    if optimizer is None:
        raise TypeError("the config's [onebit_adam] table takes over AdamW's step: pass register(..., optimizer=adamw)")
    check_adam(optimizer)
    warmup = cfg.section("onebit_adam").warmup_steps(total_steps)
    group = process_group if process_group is not None or cfg.backend != "torch" else model.process_group
    averager = ParameterAverager(cfg.method, cfg.params, process_group=group, backend=cfg.backend)
    onebit = OneBitAdam(optimizer, model.module.named_parameters(), averager, warmup)
    onebit.attach(model, group)
    return onebit
