"""The cross-group hook: HSDP whose all-reduce across replica groups goes through a commpress method.

Inside a group FSDP2 runs plainly over ``mesh["shard"]``; its ``set_all_reduce_hook`` hands each
unit's gradient shard to a :class:`~commpress.comm.averager.ParameterAverager` over
``mesh["replicate"]`` (method ``"none"``: plain HSDP). Each parameter's shard is its own slot,
so low-rank methods compress the shard's rows.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from commpress.comm import Traffic, checkpoint
from commpress.comm.averager import ParameterAverager
from commpress.comm.mesh import ReplicaGroups
from commpress.comm.pickling import BoundToProcess
from commpress.compressors import Bucket, ParamSlot, lay_out
from commpress.torch_compat import fsdp_param_groups

__all__ = ["CrossGroupHook"]


class CrossGroupHook(BoundToProcess):
    """Sets the all-reduce hook of every ``fully_shard``-ed module in ``model``."""

    def __init__(self, model: torch.nn.Module, groups: ReplicaGroups, method: str, params: Mapping[str, Any]) -> None:
        self.averager = ParameterAverager(method, params, process_group=groups.replicate)
        names = {id(p): n for n, p in model.named_parameters()}
        self.units: list[tuple[tuple[ParamSlot, ...], int]] = []  # each unit's slots and elements
        for module in (m for m in model.modules() if isinstance(m, FSDPModule)):
            param_groups = fsdp_param_groups(module._get_fsdp_state())
            if not param_groups:
                continue
            named = [(names[id(fp.sharded_param)], fp.padded_sharded_param_size) for fp in param_groups[0].fsdp_params]
            module.set_all_reduce_hook(functools.partial(self._average, len(self.units)))
            self.units.append(lay_out(named))
        self.settings = {
            "hook": "cross-group",
            "model": [[n, list(p.shape)] for n, p in model.named_parameters()],
            **groups.settings(),
        }
        self.averager.connect(self.settings, "the cross-group hook (commpress.register(..., mesh=))")

    def _average(self, index: int, output: torch.Tensor) -> None:
        """Average one unit's gradient shard over the groups, in place."""
        slots, whole = self.units[index]
        if output.numel() != whole:  # some parameters got no gradient: FSDP reduced the others only
            slots = (ParamSlot(f"unit{index}.partial{output.numel()}", torch.Size([output.numel()]), 0),)
        self.averager.average(Bucket(index, output, slots))

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank sent across the groups."""
        return self.averager.traffic

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """The averager's state (this shard's error feedback); ``full=True`` is refused."""
        if full:
            raise ValueError(
                "the cross-group hook: state_dict(full=True) cannot gather a sharded model's other shards: save every "
                "rank's state_dict() (or use torch.distributed.checkpoint with Registration.stateful(model, optimizer))"
            )
        backend = self.averager.backend
        part = {"averager": self.averager.state_dict()}
        return checkpoint.tag(part, backend.rank, backend.world_size, self.averager.calls, self.settings)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (saved by this rank, with the same config and mesh)."""
        what = "the cross-group hook: load_state_dict"
        part = self.averager.own_part(state, what)
        checkpoint.check_config(part["config"], self.settings, what)
        self.averager.load_state_dict(part["averager"])
