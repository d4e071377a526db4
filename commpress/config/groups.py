"""A model's method groups: the config's main method and each override, the compressor
that runs each, and which parameters each covers.

One object serves every user of groups (the DDP hook state, the bandwidth-aware layer,
Local SGD's averager), so group keys (``"main"``, ``"override0"``, ...), rounds and the
split of a bucket into groups are defined once.

A method with ``skip_last_layer = true`` (TernGrad) leaves the model's last layer to one
more group, ``"last_layer"``, that averages it with ``none``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from commpress.compressors import Bucket, Compressor, Context, ParamSlot, Reduction, build
from commpress.config import Config
from commpress.errors import ConfigError

__all__ = ["LAST_LAYER", "MAIN", "MethodGroups", "Part", "last_layer_names"]

#: The key of the config's top-level method.
MAIN = "main"
#: The key of the group that averages, exactly, the last layer a method leaves out.
LAST_LAYER = "last_layer"


@dataclass(frozen=True)
class Part:
    """The slots of one bucket that share a method group."""

    key: str
    slots: tuple[ParamSlot, ...]
    whole: bool  # the part covers the whole buffer, in order: no gather/scatter needed


class MethodGroups:
    """The method groups of ``config``, each with its compressor.

    ``model`` is needed when a group's method has ``skip_last_layer = true``: that group's
    share of the model's last layer (:func:`last_layer_names`, named as
    ``model.named_parameters()`` names them) goes to the ``"last_layer"`` group instead,
    averaged with ``none``. ``last_layer`` gives those names instead of a model (a hook
    state restored from a pickle).
    """

    def __init__(self, config: Config, model: nn.Module | None = None, last_layer: Iterable[str] | None = None) -> None:
        self.config = config
        self.specs: dict[str, tuple[str, dict[str, Any]]] = {MAIN: (config.method, dict(config.params))}
        for i, ov in enumerate(config.overrides):
            self.specs[f"override{i}"] = (ov.method, dict(ov.method_params))
        self.compressors: dict[str, Compressor] = {key: build(m, p) for key, (m, p) in self.specs.items()}
        #: the groups whose method leaves the last layer out, and that layer's parameter names
        self.skipping = frozenset(key for key, c in self.compressors.items() if getattr(c, "skip_last_layer", False))
        self.last_layer: frozenset[str] = frozenset()
        if self.skipping:
            if model is None and last_layer is None:
                method = self.specs[min(self.skipping)][0]
                raise ConfigError(
                    f"method {method!r}: skip_last_layer = true needs the model to find its last layer: pass "
                    "model= to CommState (commpress.register does); Local SGD averages one flat vector and cannot use it"
                )
            self.last_layer = frozenset(last_layer_names(model) if model is not None else last_layer)
            self.specs[LAST_LAYER] = ("none", {})
            self.compressors[LAST_LAYER] = build("none")
        self._parts: dict[tuple[ParamSlot, ...], tuple[Part, ...]] = {}

    @property
    def rounds(self) -> int:
        """Collectives one bucket may need: its groups run one after another."""
        return sum(c.rounds for c in self.compressors.values())

    def key_for(self, name: str) -> str:
        """The group of the parameter called ``name`` (first matching override wins; the
        last layer of a group that leaves it out goes to ``"last_layer"``)."""
        key = next((f"override{i}" for i, ov in enumerate(self.config.overrides) if ov.matches(name)), MAIN)
        return LAST_LAYER if key in self.skipping and name in self.last_layer else key

    def replace(self, key: str, compressor: Compressor) -> None:
        """Run group ``key`` with ``compressor`` from now on (the bandwidth layer changes a
        method's parameter this way)."""
        self.compressors[key] = compressor

    def parts(self, slots: tuple[ParamSlot, ...]) -> tuple[Part, ...]:
        """``slots`` split by group, in order of first appearance (cached per layout)."""
        cached = self._parts.get(slots)
        if cached is None:
            groups: dict[str, list[ParamSlot]] = {}
            for slot in slots:
                groups.setdefault(self.key_for(slot.name), []).append(slot)
            whole = len(groups) == 1
            cached = self._parts[slots] = tuple(Part(key, tuple(members), whole) for key, members in groups.items())
        return cached

    def reduction(self, bucket: Bucket, ctx: Context) -> Reduction:
        """Each group's reduction of ``bucket`` in turn; a group that is not the whole
        buffer works on a gathered copy that is scattered back afterwards. The bucket's
        average is known finite when every group's is (see :attr:`Bucket.finite`)."""
        known: list[bool | None] = []
        for part in self.parts(tuple(bucket.slots)):
            compressor = self.compressors[part.key]
            if part.whole:
                local = Bucket(bucket.index, bucket.buffer, part.slots)
                yield from compressor.reduce(local, ctx)
                known.append(local.finite)
                continue
            views = [bucket.buffer.narrow(0, s.offset, s.numel) for s in part.slots]
            local = Bucket.from_tensors(
                bucket.index, [v.view(s.shape) for v, s in zip(views, part.slots)], [s.name for s in part.slots]
            )
            yield from compressor.reduce(local, ctx)
            known.append(local.finite)
            for view, out in zip(views, _flat_views(local)):
                view.copy_(out)
        bucket.finite = _combined(known)

    def end_step(self, commit: bool) -> None:
        """Commit (or, for a non-finite step, discard) every group's staged state."""
        for compressor in self.compressors.values():
            compressor.end_step(commit)

    def state_dict(self) -> dict[str, Any]:
        return {key: c.state_dict() for key, c in self.compressors.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, c in self.compressors.items():
            c.load_state_dict(state.get(key, {}))


def _combined(known: list[bool | None]) -> bool | None:
    """Whether the parts' averages are all finite: False if one is not, None if one is unknown."""
    if False in known:
        return False
    return True if known and None not in known else None


def last_layer_names(model: nn.Module) -> list[str]:
    """The names (as ``model.named_parameters()`` gives them) of the parameters of the last
    module, in ``model.named_modules()`` order, that holds parameters of its own: the weight
    and bias of a classifier or logits layer. A weight tied to an earlier module keeps
    that module's name."""
    own: list[nn.Parameter] = []
    for _, module in model.named_modules():
        here = list(module.parameters(recurse=False))
        if here:
            own = here
    ids = {id(p) for p in own}
    return [name for name, p in model.named_parameters() if id(p) in ids]


def _flat_views(bucket: Bucket) -> Iterator:
    for s in bucket.slots:
        yield bucket.buffer.narrow(0, s.offset, s.numel)
