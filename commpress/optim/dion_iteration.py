"""Where Dion's power iteration runs, the one thing its two settings do apart.

On a fixed group (:class:`AtTheStep`) the DDP hook leaves Muon's gradients local (one
finiteness flag per bucket, so a GradScaler skips a step on every rank alike) and averages
the rest with the config's method; the iteration runs at ``muon.step()`` on the gradients as
they stand then (unscaled, clipped), every matrix in one batched pass.

Under a torchft ``Manager`` (:class:`InTheBackward`) ``should_commit()`` comes before
``muon.step()``, so the iteration runs in the backward, where a failure can still un-commit
the step: a :class:`~commpress.hooks.state.CommState` under the manager whose group of Muon's
matrices is Dion turns each gradient into its direction, and heals a (re)joining replica.
"""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations.

import glob
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from commpress.comm import Traffic, checkpoint, make_backend
from commpress.comm.averager import ParameterAverager
from commpress.comm.pickling import BoundToProcess
from commpress.comm.warm import load_kernels
from commpress.compressors import Bucket, lay_out
from commpress.compressors.dion import DionCompressor
from commpress.config import Config, Override, digest_of
from commpress.config.groups import MethodGroups
from commpress.hooks.state import CommState
from commpress.local_sgd.average import check_finite
from commpress.optim.momentum import UnderManager, spread_non_finite, written_grads

__all__ = ["AtTheStep", "DionIteration", "InTheBackward"]

NAME = "Dion"
#: Dion's group among the backward's method groups: the first (and only) override
DION_GROUP = "override0"


class _BucketSplit:
    """Where one DDP bucket's Muon matrices and other parameters sit in its flat buffer."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Mapping[int, str], muon: set[int]) -> None:
        offsets = [0, *itertools.accumulate(p.numel() for p in params)]
        device = params[0].device
        mine = [i for i, p in enumerate(params) if id(p) in muon]
        rest = [i for i, p in enumerate(params) if id(p) not in muon]
        self.key = tuple(id(p) for p in params)
        self.muon = self._index(offsets, mine, device)
        self.rest = self._index(offsets, rest, device)
        self.rest_slots, _ = lay_out((names[id(params[i])], params[i].shape) for i in rest)
        self.whole_rest = not mine

    @staticmethod
    def _index(offsets: list[int], which: list[int], device: torch.device) -> torch.Tensor | None:
        if not which:
            return None
        return torch.cat([torch.arange(offsets[i], offsets[i + 1], device=device) for i in which])


def rest_shapes(model: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.Size]]:
    """The names and shapes of the trainable parameters of ``model`` other than ``named``."""
    muon = {id(p) for _, p in named}
    return [(n, p.shape) for n, p in model.named_parameters() if p.requires_grad and id(p) not in muon]


class AtTheStep(BoundToProcess):
    """The iteration at ``muon.step()`` over ``named`` (Muon's matrices of ``model``) on
    ``process_group``: ``dion`` through one averager, the rest through ``cfg``'s method,
    both on one backend (they never overlap), so its traffic counts every byte."""

    def __init__(
        self, dion: DionCompressor, named: list[tuple[str, torch.nn.Parameter]], model: torch.nn.Module, cfg: Config,
        process_group: Any,
    ) -> None:
        self.named = named
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._muon = {id(p) for _, p in named}
        self._rest = rest_shapes(model, named)
        self.slots, numel = lay_out((n, p.shape) for n, p in named)
        self._flat = torch.empty(numel, dtype=torch.float32, device=named[0][1].device)
        rest = MethodGroups(Config(method=cfg.method, params=dict(cfg.params)))
        self.backend = make_backend(cfg.backend, process_group, max(dion.rounds, rest.rounds))
        self._process_group = process_group
        self.update = ParameterAverager(backend=self.backend, compressor=dion)
        self.rest = ParameterAverager(cfg.method, cfg.params, backend=self.backend)
        self._splits: dict[int, _BucketSplit] = {}
        self.steps = 0  # Muon steps taken since registration
        self._check_resume = False

    @property
    def traffic(self) -> Traffic:
        return self.backend.traffic

    def connect(self, settings: Mapping[str, Any]) -> None:
        """The ranks agree on ``settings``; the rest's kernels are loaded now."""
        self.update.connect(settings, NAME, self._process_group)
        self.rest.connect(settings, NAME, self._process_group)
        if self._rest:
            load_kernels(self.rest.groups, self._rest, torch.float32, self._flat.device)

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket's other parameters averaged with the method, Muon's left local (one flag)."""
        buffer, params = bucket.buffer(), bucket.parameters()
        split = self._splits.get(bucket.index())
        if split is None or split.key != tuple(id(p) for p in params):
            split = self._splits[bucket.index()] = _BucketSplit(params, self._names, self._muon)
        futures = []
        rest = None
        if split.rest is not None:
            rest = buffer if split.whole_rest else buffer.index_select(0, split.rest)
            futures.append(self.rest.start(Bucket(bucket.index(), rest, split.rest_slots)))
        if split.muon is not None:
            futures.append(self.backend.run(spread_non_finite(buffer, split.muon), buffer.device))

        def done(fut: torch.futures.Future) -> torch.Tensor:
            for f in fut.value():
                f.value()  # raises a reduction's error
            if rest is not None and rest is not buffer:
                buffer.index_copy_(0, split.rest, rest)
            return buffer

        return torch.futures.collect_all(futures).then(done)

    def directions(self, settings: Mapping[str, Any]) -> list[torch.Tensor]:
        """Each matrix's update direction from the gradients as they stand, checked finite."""
        if self._check_resume and self.backend.can_block:
            checkpoint.check_resume(self.backend, self.steps, digest_of(settings), NAME)
        self._check_resume = False
        for slot, (name, p) in zip(self.slots, self.named):
            if p.grad is None:
                raise RuntimeError(
                    f"{NAME}: parameter {name} has no gradient at step {self.steps}; every rank steps every "
                    "matrix (an unused parameter needs a zero gradient)"
                )
            self._flat.narrow(0, slot.offset, slot.numel).view(p.shape).copy_(p.grad)
        self.update.average(Bucket(0, self._flat, self.slots))
        check_finite(self._flat, NAME, self.steps)
        return [self._flat.narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots]

    def stepped(self) -> None:
        self.steps += 1

    def state_dict(self, full: bool, settings: Mapping[str, Any]) -> dict[str, Any]:
        backend = self.backend
        part = {"averager": self.update.state_dict(), "rest": self.rest.state_dict()}
        part = checkpoint.tag(part, backend.rank, backend.world_size, self.steps, settings)
        return checkpoint.gather_job(backend.allgather_object, part) if full else part

    def load_state_dict(self, state: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
        what = f"{NAME}: load_state_dict"
        part = checkpoint.own_part(state, self.backend.rank, self.backend.world_size, what, lambda _: True, _resized)
        checkpoint.check_config(part["config"], settings, what)
        self.steps = int(part["step"])
        self.update.load_state_dict(part["averager"])
        self.rest.load_state_dict(part["rest"])
        self._check_resume = True


def _resized(shared: Mapping[str, Any], parts: Sequence[Mapping[str, Any]], scale: float) -> dict[str, Any]:
    raise ValueError(
        f"[dion]: a whole-job state of {shared['world_size']} ranks loads into a job of as many ranks; each rank's "
        "momenta are its own"
    )


class InTheBackward(UnderManager):
    """The iteration per DDP bucket of ``model`` through a :class:`CommState` under
    ``manager``: ``dion`` for ``named`` (Muon's matrices), ``cfg``'s method for the rest;
    its shared state is registered with the manager under ``key``."""

    def __init__(
        self, dion: DionCompressor, named: list[tuple[str, torch.nn.Parameter]], model: torch.nn.Module, cfg: Config,
        manager: Any, key: str = "commpress_dion",
    ) -> None:
        self.named = named
        self._rest = rest_shapes(model, named)
        # the matrices' group, named by an override whose method stands in for Dion (not a
        # registered method: its result is a direction, not an average) until replaced below
        matrices = Override(tuple(glob.escape(n) for n, _ in named), "none")
        config = Config(method=cfg.method, params=dict(cfg.params), overrides=(matrices,))
        groups = MethodGroups(config, model)
        groups.replace(DION_GROUP, dion, ("dion", {"rank": dion.rank, "mu": dion.mu, "seed": dion.seed}))
        self.comm = CommState.of_part(config, model, manager=manager, key=key, groups=groups)

    def connect(self, settings: Mapping[str, Any]) -> None:
        """The rest's kernels loaded now (Dion's need none); the state connected through the
        manager when it was built."""
        if self._rest:
            rest = MethodGroups(Config(method=self.comm.config.method, params=dict(self.comm.config.params)))
            load_kernels(rest, self._rest, torch.float32, self.named[0][1].device)

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket through the manager: Muon's gradients become their directions."""
        self._step = self.comm.steps
        return self.comm.reduce(bucket.index(), bucket.buffer(), bucket.parameters(), advance=bucket.is_last())

    def directions(self, settings: Mapping[str, Any]) -> list[torch.Tensor]:
        """The directions DDP wrote into Muon's gradients, checked finite (one host sync)."""
        return written_grads([p for _, p in self.named], NAME, self._step, "matrix", "direction")


#: where a :class:`~commpress.optim.Dion` runs its power iteration
DionIteration = AtTheStep | InTheBackward
