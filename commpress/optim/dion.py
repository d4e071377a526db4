"""Dion (Ahn et al., 2025) in place of Muon's step: the orthonormal update of each matrix's
momentum computed at low rank from factors the data-parallel ranks average, so a step
sends ``(m + n) r`` numbers per m x n matrix instead of its gradient.

The user keeps ``register(ddp_model, cfg, optimizer=[muon, adamw])`` and the loop
``loss.backward(); muon.step(); adamw.step()``. In the backward the DDP hook leaves
Muon's gradients local (it sends one finiteness flag per bucket, so a GradScaler skips a
step on every rank alike) and averages the rest with the config's top-level ``method`` for
AdamW. At ``muon.step()`` the step pre-hook runs Dion's power iteration
(:class:`~commpress.compressors.dion.DionCompressor`) on the gradients as they stand then
(unscaled, clipped), applies ``p = p (1 - lr wd) - lr' P Q^T`` with Muon's lr, weight decay
and lr adjustment (``lr'``), and hides the gradients so Muon's own step skips them; the
post-hook gives them back. Muon's momentum is Dion's mu; its Newton-Schulz settings and
``nesterov`` have no part in Dion, which needs no orthogonalization of a full matrix.
"""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations.

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from commpress.comm import Traffic, checkpoint, make_backend
from commpress.comm.averager import ParameterAverager
from commpress.comm.pickling import BoundToProcess
from commpress.comm.warm import load_kernels
from commpress.compressors import Bucket, lay_out
from commpress.compressors.dion import DionCompressor
from commpress.config import Config, digest_of
from commpress.config.groups import MethodGroups
from commpress.errors import ConfigError
from commpress.hooks.removable import CommHookSwitch, register_removable_hook
from commpress.local_sgd.average import check_finite
from commpress.optim.hybrid import HybridOptimizer, describe
from commpress.optim.momentum import spread_non_finite

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


class _BucketSplit:
    """Where one DDP bucket's Muon matrices and other parameters sit in its flat buffer."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Mapping[int, str], muon: set[int]) -> None:
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
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


class Dion(BoundToProcess):
    """Dion attached to the ``torch.optim.Muon`` among ``optimizer`` on a DDP ``model``, with
    ``cfg``'s ``[dion]`` table and its top-level method for the other parameters.
    :meth:`attach` registers the DDP comm hook and Muon's step hooks (what
    :func:`commpress.register` does with a ``[dion]`` table). A non-finite update raises
    ``FloatingPointError`` on every rank and changes nothing."""

    name = "Dion"
    _hooks: tuple[RemovableHandle, ...] = ()
    _switch: CommHookSwitch | None = None
    _hidden: tuple[tuple[torch.nn.Parameter, torch.Tensor | None], ...] = ()

    def __init__(self, optimizer: Any, model: DistributedDataParallel, cfg: Config, process_group: Any = None) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"{_WHERE} runs under DistributedDataParallel; got {type(model).__name__}")
        table = cfg.section("dion")
        assert table is not None
        self.muon = find_muon(optimizer)
        self._group_of = {id(p): g for g in self.muon.param_groups for p in g["params"]}
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in named}
        self.named = [(n, p) for n, p in named if id(p) in self._group_of]
        if len(self.named) != len(self._group_of):
            raise ConfigError(f"{_WHERE}: Muon steps parameters the model does not hold: give it the model's matrices")
        self.slots, numel = lay_out((n, p.shape) for n, p in self.named)
        self._flat = torch.empty(numel, dtype=torch.float32, device=self.named[0][1].device)
        momenta = sorted({float(g["momentum"]) for g in self.muon.param_groups})
        if len(momenta) != 1:
            raise ConfigError(
                f"{_WHERE}: Muon's param groups have momentum {', '.join(map(str, momenta))}; Dion takes one mu for "
                "every matrix: give the groups one momentum"
            )
        dion = DionCompressor(table.rank, momenta[0], table.seed)
        rest = MethodGroups(Config(method=cfg.method, params=dict(cfg.params)))
        #: one backend for the backward's reductions and the step's: they never overlap
        self.backend = make_backend(cfg.backend, process_group, max(dion.rounds, rest.rounds))
        self._process_group = process_group
        self.update = ParameterAverager(backend=self.backend, compressor=dion)
        self.rest = ParameterAverager(cfg.method, cfg.params, backend=self.backend)
        self._steps = 0
        self._check_resume = False
        self._splits: dict[int, _BucketSplit] = {}
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
        """Muon steps taken since registration."""
        return self._steps

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank sent: the factors, the flags and the other parameters' gradients."""
        return self.backend.traffic

    def attach(self, model: DistributedDataParallel) -> None:
        """The ranks agree on the settings, then the DDP comm hook on ``model`` (before its
        first backward) and Muon's step hooks."""
        self.update.connect(self.settings, self.name, self._process_group)
        self.rest.connect(self.settings, self.name, self._process_group)
        rest = [(n, p.shape) for n, p in model.module.named_parameters() if p.requires_grad and id(p) not in self._group_of]
        if rest:
            load_kernels(self.rest.groups, rest, torch.float32, self._flat.device)
        self._switch = register_removable_hook(model, self, comm_hook)
        self._hooks = (
            self.muon.register_step_pre_hook(lambda optimizer, args, kwargs: self._pre_step()),
            self.muon.register_step_post_hook(lambda optimizer, args, kwargs: self._post_step()),
        )

    def detach(self) -> None:
        """Take off what :meth:`attach` registered: DDP all-reduces gradients again and
        ``muon.step()`` is Muon's own step."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = ()
        if self._switch is not None:
            self._switch.remove()

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The bucket's other parameters averaged with the method, Muon's left local (one flag)."""
        buffer, params = bucket.buffer(), bucket.parameters()
        split = self._splits.get(bucket.index())
        if split is None or split.key != tuple(id(p) for p in params):
            split = self._splits[bucket.index()] = _BucketSplit(params, self._names, set(self._group_of))
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

    def _pre_step(self) -> None:
        """Dion's update of every Muon matrix; Muon's own step then skips them."""
        if self._check_resume and self.backend.can_block:
            checkpoint.check_resume(self.backend, self._steps, digest_of(self.settings), self.name)
        self._check_resume = False
        for slot, (name, p) in zip(self.slots, self.named):
            if p.grad is None:
                raise RuntimeError(
                    f"{self.name}: parameter {name} has no gradient at step {self._steps}; every rank steps every "
                    "matrix (an unused parameter needs a zero gradient)"
                )
            self._flat.narrow(0, slot.offset, slot.numel).view(p.shape).copy_(p.grad)
        self.update.average(Bucket(0, self._flat, self.slots))
        check_finite(self._flat, self.name, self._steps)
        with torch.no_grad():
            for slot, (_, p) in zip(self.slots, self.named):
                self._apply(p, self._flat.narrow(0, slot.offset, slot.numel).view(p.shape))
        self._hidden = tuple((p, p.grad) for _, p in self.named)
        for _, p in self.named:
            p.grad = None

    def _apply(self, p: torch.nn.Parameter, direction: torch.Tensor) -> None:
        group = self._group_of[id(p)]
        lr = float(group["lr"])
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(direction.to(p.dtype), alpha=-lr * muon_lr_scale(group["adjust_lr_fn"], p.shape))

    def _post_step(self) -> None:
        for p, grad in self._hidden:
            p.grad = grad
        self._hidden = ()
        self._steps += 1

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """The step counter, each rank's momenta (Dion's error memory), the shared Q and the
        other parameters' method state, tagged with this rank, the world size and the
        settings; ``full=True``: every rank's (a collective)."""
        backend = self.backend
        part = {"averager": self.update.state_dict(), "rest": self.rest.state_dict()}
        part = checkpoint.tag(part, backend.rank, backend.world_size, self._steps, self.settings)
        return checkpoint.gather_job(backend.allgather_object, part) if full else part

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's part, or its part of a whole-job state of as many ranks."""
        what = f"{self.name}: load_state_dict"
        part = checkpoint.own_part(state, self.backend.rank, self.backend.world_size, what, lambda _: True, _resized)
        checkpoint.check_config(part["config"], self.settings, what)
        self._steps = int(part["step"])
        self.update.load_state_dict(part["averager"])
        self.rest.load_state_dict(part["rest"])
        self._check_resume = True


def _resized(shared: Mapping[str, Any], parts: Sequence[Mapping[str, Any]], scale: float) -> dict[str, Any]:
    raise ValueError(
        f"{_WHERE}: a whole-job state of {shared['world_size']} ranks loads into a job of as many ranks; each rank's "
        "momenta are its own"
    )


def comm_hook(state: Dion, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook of Dion: the bucket's reduction (:meth:`Dion.reduce`)."""
    return state.reduce(bucket)
