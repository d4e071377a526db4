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
        self._layouts: dict[int, tuple[tuple[int, ...], tuple[_Part, ...]]] = {}
        self._check_same_config()

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
            cached = self._layouts[index] = (members, self._layout(buffer, params))
        layout = cached[1]
        ctx = Context(rank=self.rank, world_size=self.world_size, step=self.step)
        if self.step < self.config.start_iter:
            gen = self._warmup.reduce(Bucket(index, buffer), ctx)
        else:
            gen = self._run_parts(index, buffer, layout, ctx)
        if advance:
            self.step += 1
        return self.backend.run(gen, buffer)

    def _layout(self, buffer: torch.Tensor, params: Sequence[torch.Tensor] | None) -> tuple[_Part, ...]:
        if params is None:
            return (_Part("main", (ParamSlot("flat", buffer.shape, 0),), True),)
        groups: dict[str, list[ParamSlot]] = {}
        offset = 0
        for i, p in enumerate(params):
            name = self._names.get(id(p), f"param{i}")
            key = self._group_key(name)
            groups.setdefault(key, []).append(ParamSlot(name, p.shape, offset))
            offset += p.numel()
        if offset != buffer.numel():
            raise ValueError(f"bucket parameters hold {offset} elements, its buffer {buffer.numel()}")
        whole = len(groups) == 1
        return tuple(_Part(key, tuple(slots), whole) for key, slots in groups.items())

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
        return {
            "step": self.step,
            "config_digest": self.config.digest(),
            "compressors": {key: c.state_dict() for key, c in self.compressors.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the config must be the one the state was saved with."""
        if state.get("config_digest") != self.config.digest():
            raise ConfigError(
                f"checkpoint was saved with config {state.get('config_digest')}, this state has "
                f"{self.config.digest()}: load it with the same config"
            )
        self.step = int(state["step"])
        for key, c in self.compressors.items():
            c.load_state_dict(state["compressors"].get(key, {}))


def _flat_views(bucket: Bucket) -> Iterator[torch.Tensor]:
    for s in bucket.slots:
        yield bucket.buffer[s.offset : s.offset + s.numel]
