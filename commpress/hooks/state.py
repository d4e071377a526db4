"""CommState: a config's method groups plus a backend, the state object of commpress hooks."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed

from commpress.comm import Backend, make_backend
from commpress.comm.agreement import agree_on_config
from commpress.compressors import Bucket, Context, ParamSlot, build, host
from commpress.config import Config
from commpress.config.groups import MethodGroups
from commpress.config.tables import APPLIED_BY
from commpress.errors import ConfigError

__all__ = ["CommState", "check_model"]


class CommState:
    """Everything a commpress hook needs: the resolved config, its method groups, the
    backend, and the step counter.

    Like PyTorch's ``PowerSGDState`` it may be built before ``init_process_group``
    (Lightning builds hook states first): it then connects at the first reduction. On
    connecting (at construction when torch.distributed is up) every rank compares a hash of the resolved config before any
    collective whose shape depends on it, and raises :class:`ConfigError` if any differs.

    A step's state changes (error feedback, warm starts, the step counter) are committed
    together when the next step starts, or discarded if any bucket's average was
    non-finite (GradScaler then skips the step): training continues exactly as if that
    step had not happened.
    """

    def __init__(
        self,
        config: Config | Mapping[str, Any] | str | None = None,
        model: torch.nn.Module | None = None,
        process_group: Any = None,
        backend: Backend | None = None,
    ) -> None:
        self.config = Config.load(config)
        for table in ("local_sgd", "fsdp"):
            if self.config.section(table) is not None:
                raise ConfigError(
                    f"the config's [{table}] table is not applied by the DDP hook: apply it with {APPLIED_BY[table]}, "
                    f"and give the hook a config without [{table}]"
                )
        if self.config.overrides and model is None:
            raise ConfigError("config has overrides by parameter name: pass model= so names can be resolved")
        self.groups = MethodGroups(self.config, model)
        self._names: dict[int, str] = {}
        if model is not None:
            check_model(model, self.config, self.groups)
            self._names = {id(p): n for n, p in model.named_parameters()}
        self._model = model
        self._process_group = process_group
        self._backend = backend
        self._warmup = build("none")
        self.adaptive = None
        self.step = 0
        self._layouts: dict[int, tuple[tuple[int, ...], tuple[ParamSlot, ...]]] = {}
        self._step_open = False  # a bucket of the current step has been seen
        self._finite: list[torch.Tensor] = []  # one flag per bucket of the open step
        self._saved: Mapping[str, Any] | None = None  # loaded before connect()
        if backend is not None or self.config.backend != "torch" or torch.distributed.is_initialized():
            self.connect()  # fail early where we can; lazy only before init_process_group

    # ---- set-up ------------------------------------------------------------------------

    def connect(self) -> None:
        """Agree on the config across ranks, then open the backend (and the bandwidth
        layer). Called by the first reduction; call it yourself to fail early."""
        if self._backend is None:
            agree_on_config(self.config, "the DDP hook state (CommState)", self.config.backend, self._process_group)
            self._backend = make_backend(self.config.backend, self._process_group, self.groups.rounds)
        bandwidth = self.config.section("bandwidth")
        if self.adaptive is None and bandwidth is not None and bandwidth.adaptive:
            from commpress.adaptive.layer import AdaptiveLayer

            self.adaptive = AdaptiveLayer(self.groups, bandwidth, self._model, self._process_group, self._backend)
        if self._saved is not None:
            saved, self._saved = self._saved, None
            self.load_state_dict(saved)

    @property
    def backend(self) -> Backend:
        self.connect()
        return self._backend

    @property
    def compressors(self):
        """Each method group's compressor, by group key (``"main"``, ``"override0"``, ...)."""
        return self.groups.compressors

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    @property
    def traffic(self):
        """Bytes sent and compute time of this rank (see :class:`commpress.comm.Traffic`)."""
        return self.backend.traffic

    # ---- reducing ----------------------------------------------------------------------

    def reduce(
        self,
        index: int,
        buffer: torch.Tensor,
        params: Sequence[torch.Tensor] | None = None,
        advance: bool = True,
    ) -> torch.futures.Future:
        """Average the flat gradient ``buffer`` of bucket ``index`` across ranks.

        ``params`` are the parameters whose gradients the buffer holds, in order (their
        names select overrides and key the compressors' state). The future completes with
        ``buffer``, averaged in place. ``advance`` marks the last bucket of the step.
        """
        first_bucket = not self._step_open
        if first_bucket:
            self.end_step()
        self.connect()
        # DDP rebuilds its buckets after the first step: re-derive when the members change.
        members = tuple(id(p) for p in params) if params is not None else (buffer.numel(),)
        cached = self._layouts.get(index)
        if cached is None or cached[0] != members:
            cached = self._layouts[index] = (members, self._slots(buffer, params))
        slots = cached[1]
        self._step_open = not advance
        step = self.step
        if advance:
            self.step += 1
        bucket = Bucket(index, buffer, slots)
        ctx = Context(rank=self.rank, world_size=self.world_size, step=step)
        if step < self.config.start_iter:
            fut = self._backend.run(self._warmup.reduce(bucket, ctx), buffer)
        elif self.adaptive is not None:
            if first_bucket:  # no reduction of this state is in flight: safe to re-measure
                self.adaptive.begin_step(step)
            fut = self.adaptive.run(bucket, step)
        else:
            fut = self._backend.run(self.groups.reduction(bucket, ctx), buffer)
        return fut.then(functools.partial(self._record_finite, bucket))

    def _record_finite(self, bucket: Bucket, fut: torch.futures.Future) -> torch.Tensor:
        try:
            buffer = fut.value()
        except BaseException:
            self._finite.append(torch.tensor(False))  # a failed bucket discards the whole step
            raise
        # the reduction's own finding where it has one (no second pass over the buffer)
        self._finite.append(host.finite(buffer) if bucket.finite is None else torch.tensor(bucket.finite))
        return buffer

    def end_step(self) -> None:
        """Commit the finished step's state changes, or discard them (and the step) if any
        bucket's average was non-finite. Runs by itself when the next step starts."""
        if not self._finite:
            return
        flags, self._finite = self._finite, []
        finite = step_was_finite(flags)
        self.groups.end_step(finite)
        if not finite:
            self.step -= 1

    def _slots(self, buffer: torch.Tensor, params: Sequence[torch.Tensor] | None) -> tuple[ParamSlot, ...]:
        if params is None:
            return (ParamSlot("flat", buffer.shape, 0),)
        slots, offset = [], 0
        for p in params:
            # without a model: names in order of first appearance, the same on every rank
            name = self._names.setdefault(id(p), f"param{len(self._names)}")
            slots.append(ParamSlot(name, p.shape, offset))
            offset += p.numel()
        if offset != buffer.numel():
            raise ValueError(f"bucket parameters hold {offset} elements, its buffer {buffer.numel()}")
        return tuple(slots)

    # ---- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step counter and every compressor's committed state, for checkpoints."""
        self.end_step()
        state = {"step": self.step, "config_digest": self.config.digest(), "compressors": self.groups.state_dict()}
        if self.adaptive is not None:
            state["adaptive"] = self.adaptive.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the config must be the one the state was saved with."""
        if state.get("config_digest") != self.config.digest():
            raise ConfigError(
                f"checkpoint was saved with config {state.get('config_digest')}, this state has "
                f"{self.config.digest()}: load it with the same config"
            )
        if "adaptive" in state and self.adaptive is None:
            self._saved = state  # the bandwidth layer exists once connected
            return
        self._finite = []
        self.step = int(state["step"])
        if self.adaptive is not None:  # first: it rebuilds the compressors of the saved plan
            self.adaptive.load_state_dict(state["adaptive"])
        self.groups.load_state_dict(state["compressors"])


def step_was_finite(flags: Sequence[torch.Tensor]) -> bool:
    """Whether every bucket's average was finite: the one host transfer per step."""
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all().item())


def check_model(model: torch.nn.Module, config: Config, groups: MethodGroups) -> None:
    """Refuse, at registration, what the hooks cannot reduce: sparse gradients, parameter
    dtypes a group's method does not take, override globs that match no parameter."""
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) is True:
            raise ConfigError(
                f"module {name or type(module).__name__!r} ({type(module).__name__}) has sparse=True: DDP comm hooks "
                "reduce dense gradient buckets only; construct it with sparse=False to use commpress"
            )
    names = []
    for name, p in model.named_parameters():
        names.append(name)
        if not p.requires_grad:
            continue
        key = groups.key_for(name)
        compressor = groups.compressors[key]
        if p.dtype not in compressor.dtypes:
            accepted = ", ".join(str(d).removeprefix("torch.") for d in compressor.dtypes)
            raise ConfigError(
                f"parameter {name!r} has dtype {str(p.dtype).removeprefix('torch.')}, which method "
                f"{compressor.name!r} does not take (accepted: {accepted}); convert the model or add an override "
                f'that sends it with a method that does (e.g. params = ["{name}"], method = "none" if accepted there)'
            )
    unmatched = config.unmatched_overrides(names)
    if unmatched:
        raise ConfigError(f"overrides: params {unmatched} match no parameter of the model (names look like {names[:3]})")
