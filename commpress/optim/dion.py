"""Dion (Ahn et al., 2025) in place of Muon's step: each matrix's orthonormal update from a
low-rank power iteration whose factors the ranks average, ``(m + n) r`` numbers per m x n
matrix instead of its gradient.

The user keeps ``register(ddp_model, cfg, optimizer=[muon, adamw])`` and their loop; the
other parameters are averaged with the config's ``method`` for AdamW. The step pre-hook
applies ``p = p (1 - lr wd) - lr' P Q^T`` with Muon's lr, weight decay and lr adjustment,
and hides the gradients so Muon's own step skips them. Muon's momentum is Dion's mu; its
Newton-Schulz settings and ``nesterov`` have no part in Dion.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from commpress.comm import Traffic
from commpress.compressors.dion import DionCompressor
from commpress.config import Config
from commpress.errors import ConfigError
from commpress.optim.dion_iteration import AtTheStep, DionIteration, InTheBackward
from commpress.optim.hybrid import HybridOptimizer, describe
from commpress.optim.takeover import StepTakeover

__all__ = ["Dion", "muon_lr_scale"]

_WHERE = "[dion]"


def muon_lr_scale(adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """What ``torch.optim.Muon`` multiplies its lr by for a matrix of ``shape`` (rows, cols)."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else 1.0


def find_muon(optimizer: Any) -> torch.optim.Optimizer:
    """The one ``torch.optim.Muon`` among the optimizers ``register()`` was given."""
    members = optimizer.optimizers if isinstance(optimizer, HybridOptimizer) else [optimizer]
    muons = [o for o in members if isinstance(o, torch.optim.Muon)]
    if len(muons) != 1:
        given = "; ".join(describe(o) for o in members)
        raise ConfigError(
            f"{_WHERE} takes over the step of one torch.optim.Muon; got {len(muons)} among: {given}: pass "
            "register(..., optimizer=[muon, adamw]) with Muon over the hidden matrices"
        )
    return muons[0]


class Dion(StepTakeover):
    """Dion attached to the ``torch.optim.Muon`` among ``optimizer`` on a DDP ``model``, with
    ``cfg``'s ``[dion]`` table and its top-level method for the other parameters, its power
    iteration at Muon's step on ``process_group``, or in the backward under a torchft
    ``manager`` (:mod:`commpress.optim.dion_iteration`). :meth:`attach` registers the DDP
    comm hook and Muon's step hooks (what :func:`commpress.register` does with a ``[dion]``
    table). A non-finite update raises ``FloatingPointError`` on every rank and changes nothing."""

    name = "Dion"

    def __init__(
        self, optimizer: Any, model: DistributedDataParallel, cfg: Config, process_group: Any = None, manager: Any = None
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"{_WHERE} runs under DistributedDataParallel; got {type(model).__name__}")
        table = cfg.section("dion")
        assert table is not None
        self.muon = find_muon(optimizer)
        self._group_of = {id(p): g for g in self.muon.param_groups for p in g["params"]}
        self.named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad and id(p) in self._group_of]
        if len(self.named) != len(self._group_of):
            raise ConfigError(f"{_WHERE}: Muon steps parameters the model does not hold: give it the model's matrices")
        momenta = sorted({float(g["momentum"]) for g in self.muon.param_groups})
        if len(momenta) != 1:
            raise ConfigError(
                f"{_WHERE}: Muon's param groups have momentum {', '.join(map(str, momenta))}; Dion takes one mu for "
                "every matrix: give the groups one momentum"
            )
        dion = DionCompressor(table.rank, momenta[0], table.seed)
        self.iteration: DionIteration = (
            AtTheStep(dion, self.named, model.module, cfg, process_group)
            if manager is None
            else InTheBackward(dion, self.named, model.module, cfg, manager)
        )
        self.settings = {
            "algorithm": "dion",
            "rank": table.rank,
            "seed": table.seed,
            "mu": momenta[0],
            "method": cfg.method,
            "params": dict(cfg.params),
            "matrices": [[n, list(p.shape)] for n, p in self.named],
        }

    @property
    def steps(self) -> int:
        """Muon steps taken since registration (under a manager: the committed ones)."""
        return self.iteration.steps

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank sent: the factors, the flags and the other parameters' gradients."""
        return self.iteration.traffic

    def attach(self, model: DistributedDataParallel) -> None:
        """The ranks agree on the settings, then the DDP comm hook on ``model`` (before its
        first backward) and Muon's step hooks."""
        self.iteration.connect(self.settings)
        self._take_over(model, self.muon, self.iteration)

    def _pre_step(self) -> None:
        """Dion's update of every Muon matrix; Muon's own step then skips them."""
        directions = self.iteration.directions(self.settings)
        with torch.no_grad():
            for (_, p), direction in zip(self.named, directions):
                group = self._group_of[id(p)]
                lr = float(group["lr"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(direction.to(p.dtype), alpha=-lr * muon_lr_scale(group["adjust_lr_fn"], p.shape))
        self._hide_grads(p for _, p in self.named)

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """The step counter, each rank's momenta (Dion's error memory), the shared Q and the
        other parameters' method state, tagged with this rank, the world size and the
        settings; ``full=True``: every rank's (a collective)."""
        return self.iteration.state_dict(full, self.settings)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's part, or its part of a whole-job state of as many ranks."""
        self.iteration.load_state_dict(state, self.settings)
