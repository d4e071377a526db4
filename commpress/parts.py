"""The parts :func:`commpress.register` applies, one class each, by the names the matrix
(:mod:`commpress.config.matrix`) picks them by: each wraps the object a registration names after
it and answers its questions alike. A new part is one class here and one entry in the matrix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from commpress.comm import Traffic
from commpress.comm.averager import ParameterAverager
from commpress.comm.mesh import replica_groups
from commpress.config import Config
from commpress.fsdp import FSDP2State, apply
from commpress.fsdp.groups import CrossGroupHook
from commpress.hooks.ddp import attach_ddp_hook
from commpress.local_sgd.config import build_trainer
from commpress.optim import AtTheStep, Dion, InTheBackward, OneBitAdam, check_adam
from commpress.optim.hybrid import check_step_hooks
from commpress.optim.momentum import MomentumAverage

__all__ = ["PART_TYPES", "AppliedPart", "Request"]


@dataclass(frozen=True)
class Request:
    """What :func:`commpress.register` was handed besides the model and the config."""

    optimizer: torch.optim.Optimizer | None = None
    process_group: Any = None
    total_steps: int | None = None
    manager: Any = None
    mesh: Any = None

    def optimizer_for(self, table: str, what: str) -> torch.optim.Optimizer:
        """The optimizer, which ``table`` needs (``what``: the rest of the sentence)."""
        if self.optimizer is None:
            raise TypeError(f"the config's [{table}] table {what}")
        return self.optimizer


class AppliedPart:
    """One applied part: ``target`` is the object :class:`~commpress.Registration` names
    after the part (``reg.hook``, ``reg.local_sgd``, ...)."""

    #: the part's name in :data:`commpress.config.matrix.PARTS` and in the registration's state_dict
    name: ClassVar[str]
    #: whether :meth:`remove` can take the part off (a sharded model's collectives cannot)
    removable: ClassVar[bool] = True

    def __init__(self, target: Any) -> None:
        self.target = target

    @classmethod
    def build(cls, model: torch.nn.Module, cfg: Config, request: Request) -> AppliedPart:
        """The part applied to ``model``."""
        raise NotImplementedError

    @property
    def traffic(self) -> Traffic:
        """What this rank sent through the part."""
        return self.target.traffic

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        return self.target.state_dict(full=full)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.target.load_state_dict(state)

    def remove(self) -> None:
        """Take the part's hooks off the model and the optimizer."""

    def finish(self) -> None:
        """The end of training (nothing left to do for most parts)."""

    def averaged(self) -> contextlib.AbstractContextManager[None]:
        """A block in which the model holds the job's model (every rank already does for most parts)."""
        return contextlib.nullcontext()


class DDPHook(AppliedPart):
    """The DDP comm hook (:class:`~commpress.hooks.CommState`), under a torchft Manager too."""

    name = "ddp_hook"

    def __init__(self, target: Any, take_off: Callable[[], None] | None = None) -> None:
        super().__init__(target)
        self._take_off = take_off

    @classmethod
    def build(cls, model: torch.nn.Module, cfg: Config, request: Request) -> DDPHook:
        return cls(*attach_ddp_hook(model, cfg, request.process_group, request.optimizer, request.manager))

    def remove(self) -> None:
        if self._take_off is not None:
            self._take_off()
            self._take_off = None


class GroupsHook(AppliedPart):
    """The cross-group gradient hook of a model sharded inside replica groups."""

    name = "groups_hook"
    removable = False

    @classmethod
    def build(cls, model: torch.nn.Module, cfg: Config, request: Request) -> GroupsHook:
        return cls(CrossGroupHook(model, replica_groups(request.mesh, model), cfg.method, cfg.params))


class FSDPPart(AppliedPart):
    """``[fsdp]``: a sharded model's own collectives, quantized (FSDP2 or an FSDP1 root)."""

    name = "fsdp"
    removable = False

    @classmethod
    def build(cls, model: torch.nn.Module, cfg: Config, request: Request) -> FSDPPart:
        return cls(apply(model, cfg.section("fsdp")))

    @property
    def traffic(self) -> Traffic:
        """For FSDP2, the all-gather's and the reduce-scatter's summed."""
        if not isinstance(self.target, FSDP2State):
            return self.target.traffic
        summed = {k: sum(s[k] for s in self.target.traffic().values()) for k in ("bytes_sent", "collectives", "compute_seconds")}
        return Traffic(int(summed["bytes_sent"]), int(summed["collectives"]), summed["compute_seconds"])


class LocalSGDPart(AppliedPart):
    """``[local_sgd]``: the Local SGD / CO2 / DiLoCo trainer, run by the optimizer's step hooks."""

    name = "local_sgd"

    @classmethod
    def build(cls, model: torch.nn.Module, cfg: Config, request: Request) -> LocalSGDPart:
        optimizer = request.optimizer_for("local_sgd", "runs at the optimizer's step: pass register(..., optimizer=optimizer)")
        check_step_hooks(optimizer, "the config's [local_sgd] table")
        trainer = build_trainer(
            model,
            optimizer,
            cfg,
            total_steps=request.total_steps,
            process_group=request.process_group,
            mesh=request.mesh,
            manager=request.manager,
        )
        trainer.register_optimizer_hooks()
        return cls(trainer)

    def remove(self) -> None:
        self.target.remove_hooks()

    def finish(self) -> None:
        self.target.finish()

    def averaged(self) -> contextlib.AbstractContextManager[None]:
        return self.target.averaged()


class OneBitAdamPart(AppliedPart):
    """``[onebit_adam]``: 1-bit Adam on the user's AdamW and the DDP model."""

    name = "onebit_adam"

    @classmethod
    def build(cls, model: torch.nn.Module, cfg: Config, request: Request) -> OneBitAdamPart:
        optimizer = request.optimizer_for("onebit_adam", "takes over AdamW's step: pass register(..., optimizer=adamw)")
        check_adam(optimizer)  # before the warm-up's fraction asks for total_steps
        warmup = cfg.section("onebit_adam").warmup_steps(request.total_steps)
        group = None
        if request.manager is not None:
            average: MomentumAverage = InTheBackward.of(model.module, request.manager, cfg.method, cfg.params, warmup)
        else:
            group = cfg.group_for(model, request.process_group)
            average = AtTheStep(ParameterAverager(cfg.method, cfg.params, process_group=group, backend=cfg.backend))
        onebit = OneBitAdam(optimizer, model.module.named_parameters(), average, warmup)
        onebit.attach(model, group)
        return cls(onebit)

    def remove(self) -> None:
        self.target.detach()


class DionPart(AppliedPart):
    """``[dion]``: Dion in place of Muon's step on the DDP model, the rest through the method."""

    name = "dion"

    @classmethod
    def build(cls, model: torch.nn.Module, cfg: Config, request: Request) -> DionPart:
        optimizer = request.optimizer_for("dion", "takes over Muon's step: pass register(..., optimizer=[muon, adamw])")
        group = None if request.manager is not None else cfg.group_for(model, request.process_group)
        dion = Dion(optimizer, model, cfg, group, manager=request.manager)
        dion.attach(model)
        return cls(dion)

    def remove(self) -> None:
        self.target.detach()


#: Every part by its name in :data:`commpress.config.matrix.PARTS`.
PART_TYPES: dict[str, type[AppliedPart]] = {
    p.name: p for p in (DDPHook, GroupsHook, FSDPPart, LocalSGDPart, OneBitAdamPart, DionPart)
}
