"""CommState: a config's compressors plus a backend, the state object of commpress hooks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from commpress.comm import Backend, make_backend
from commpress.compressors import Bucket, Compressor, Context, ParamSlot, Reduction, build
from commpress.config import Config
from commpress.errors import ConfigError

__all__ = ["CommState"]


@dataclass(frozen=True)
class _Part:
    """The parameters of one bucket that share a compressor."""

    key: str
    slots: tuple[ParamSlot, ...]
    whole: bool  # the part covers the whole buffer, in order: no gather/scatter needed


class CommState:
    """Everything a commpress hook needs: the resolved config, one compressor per method
    group (main method and each override), the backend, and the step counter.

    Build it on every rank with the same config; construction compares a hash of the
    resolved config across ranks and raises :class:`ConfigError` if any differs.
    """

    def __init__(
        self,
        config: Config | Mapping[str, Any] | str | None = None,
        model: torch.nn.Module | None = None,
        process_group: Any = None,
        backend: Backend | None = None,
    ) -> None:
        self.config = Config.load(config)
        if self.config.overrides and model is None:
            raise ConfigError("config has overrides by parameter name: pass model= so names can be resolved")
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self.compressors: dict[str, Compressor] = {"main": self.config.build_compressor()}
        for i, ov in enumerate(self.config.overrides):
            self.compressors[f"override{i}"] = build(ov.method, ov.method_params)
        self._warmup = build("none")
        # method groups of one bucket run one after another: their rounds add up
        rounds = sum(c.rounds for c in self.compressors.values())
        self.backend = backend if backend is not None else make_backend(self.config.backend, process_group, rounds)
        self.step = 0
        self._layouts: dict[int, tuple[tuple[int, ...], tuple[_Part, ...], tuple[ParamSlot, ...]]] = {}
        self._step_open = False  # a bucket of the current step has been seen
        self._check_same_config()
        # [bandwidth] adaptive = true: measured links, a plan, hierarchical reduction
        bandwidth = self.config.section("bandwidth")
        self.adaptive = None
        if bandwidth is not None and bandwidth.adaptive:
            from commpress.hooks.adaptive import AdaptiveLayer

            self.adaptive = AdaptiveLayer(self, bandwidth, model, process_group)

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

    def _check_same_config(self) -> None:
        digests = self.backend.allgather_object(self.config.digest())
        if len(set(digests)) > 1:
            mine = self.config.digest()
            others = [r for r, d in enumerate(digests) if d != mine]
            raise ConfigError(
                f"commpress config differs across ranks (rank {self.rank} has {mine}, ranks {others} differ): "
                f"every rank must use the same config; this rank's is {self.config.to_dict()}"
            )

    def reduce(
        self,
        index: int,
        buffer: torch.Tensor,
        params: Sequence[torch.Tensor] | None = None,
        advance: bool = True,
    ) -> torch.futures.Future:
        """Average the flat gradient ``buffer`` of bucket ``index`` across ranks.

        ``params`` are the parameters whose gradients the buffer holds, in order (their
        names select overrides). The future completes with ``buffer``, averaged in place.
        ``advance`` counts a step when this is the last bucket of the step.
        """
        # DDP rebuilds its buckets after the first step: re-derive when the members change.
        members = tuple(id(p) for p in params) if params is not None else (buffer.numel(),)
        cached = self._layouts.get(index)
        if cached is None or cached[0] != members:
            slots = self._slots(buffer, params)
            cached = self._layouts[index] = (members, self._parts(slots), slots)
        _, layout, slots = cached
        first_bucket, self._step_open = not self._step_open, not advance
        ctx = Context(rank=self.rank, world_size=self.world_size, step=self.step)
        step = self.step
        if advance:
            self.step += 1
        if step < self.config.start_iter:
            return self.backend.run(self._warmup.reduce(Bucket(index, buffer), ctx), buffer)
        if self.adaptive is not None:
            if first_bucket:  # no reduction of this state is in flight: safe to re-measure
                self.adaptive.begin_step(step)
            return self.adaptive.run(index, buffer, slots, self._shard_reduction, step)
        return self.backend.run(self._run_parts(index, buffer, layout, ctx), buffer)

    def _shard_reduction(self, bucket: Bucket, ctx: Context) -> Reduction:
        """The method groups' reduction of a bucket given by its slots (hierarchical shards)."""
        return self._run_parts(bucket.index, bucket.buffer, self._parts(tuple(bucket.slots)), ctx)

    def _slots(self, buffer: torch.Tensor, params: Sequence[torch.Tensor] | None) -> tuple[ParamSlot, ...]:
        if params is None:
            return (ParamSlot("flat", buffer.shape, 0),)
        slots, offset = [], 0
        for i, p in enumerate(params):
            slots.append(ParamSlot(self._names.get(id(p), f"param{i}"), p.shape, offset))
            offset += p.numel()
        if offset != buffer.numel():
            raise ValueError(f"bucket parameters hold {offset} elements, its buffer {buffer.numel()}")
        return tuple(slots)

    def _parts(self, slots: tuple[ParamSlot, ...]) -> tuple[_Part, ...]:
        groups: dict[str, list[ParamSlot]] = {}
        for slot in slots:
            groups.setdefault(self._group_key(slot.name), []).append(slot)
        whole = len(groups) == 1
        return tuple(_Part(key, tuple(members), whole) for key, members in groups.items())

    def _group_key(self, name: str) -> str:
        for i, ov in enumerate(self.config.overrides):
            if ov.matches(name):
                return f"override{i}"
        return "main"

    def _run_parts(self, index: int, buffer: torch.Tensor, layout: tuple[_Part, ...], ctx: Context) -> Reduction:
        """Each method group's reduction in turn; groups that are not the whole buffer work
        on a gathered copy that is scattered back afterwards."""
        for part in layout:
            compressor = self.compressors[part.key]
            if part.whole:
                yield from compressor.reduce(Bucket(index, buffer, part.slots), ctx)
                continue
            views = [buffer[s.offset : s.offset + s.numel] for s in part.slots]
            local = Bucket.from_tensors(index, [v.view(s.shape) for v, s in zip(views, part.slots)], [s.name for s in part.slots])
            yield from compressor.reduce(local, ctx)
            for view, out in zip(views, _flat_views(local)):
                view.copy_(out)

    def state_dict(self) -> dict[str, Any]:
        """Step counter and every compressor's state, for checkpoints."""
        state = {
            "step": self.step,
            "config_digest": self.config.digest(),
            "compressors": {key: c.state_dict() for key, c in self.compressors.items()},
        }
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
        self.step = int(state["step"])
        if self.adaptive is not None:  # first: it rebuilds the compressors of the saved plan
            self.adaptive.load_state_dict(state["adaptive"])
        for key, c in self.compressors.items():
            c.load_state_dict(state["compressors"].get(key, {}))


def _flat_views(bucket: Bucket) -> Iterator[torch.Tensor]:
    for s in bucket.slots:
        yield bucket.buffer[s.offset : s.offset + s.numel]
