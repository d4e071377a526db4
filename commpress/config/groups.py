"""A model's method groups (the config's main method and each override, with their compressors
and parameters), defined once for every user. A method with ``skip_last_layer = true`` (TernGrad)
leaves the model's last layer to one more group, ``"last_layer"``, averaged exactly."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from commpress.compressors import EXACT, Compressor, build, without_per_rank
from commpress.compressors.composite import Composite
from commpress.config import Config
from commpress.errors import ConfigError

__all__ = ["LAST_LAYER", "MAIN", "MethodGroups", "last_layer_names"]

#: The key of the config's top-level method.
MAIN = "main"
#: The key of the group that averages, exactly, the last layer a method leaves out.
LAST_LAYER = "last_layer"


class MethodGroups:
    """The method groups of ``config``, each with its compressor; a method that skips the last
    layer needs ``model``, or the ``last_layer`` names (a state restored from a pickle)."""

    def __init__(self, config: Config, model: nn.Module | None = None, last_layer: Iterable[str] | None = None) -> None:
        self.config = config
        #: each group's (method, params) in force: the configured ones until the bandwidth layer sets its own
        self.specs: dict[str, tuple[str, dict[str, Any]]] = {MAIN: (config.method, dict(config.params))}
        for i, ov in enumerate(config.overrides):
            self.specs[f"override{i}"] = (ov.method, dict(ov.method_params))
        self.compressors: dict[str, Compressor] = {key: build(m, p) for key, (m, p) in self.specs.items()}
        #: the groups whose method leaves the last layer out, and that layer's parameter names
        self.skipping = frozenset(key for key, c in self.compressors.items() if c.skip_last_layer)
        self.last_layer: frozenset[str] = frozenset()
        if self.skipping:
            if model is None and last_layer is None:
                method = self.specs[min(self.skipping)][0]
                raise ConfigError(
                    f"method {method!r}: skip_last_layer = true needs the model to find its last layer: pass "
                    "model= to CommState (commpress.register does); Local SGD averages one flat vector and cannot use it"
                )
            self.last_layer = frozenset(last_layer_names(model) if model is not None else last_layer)
            self.specs[LAST_LAYER] = (EXACT, {})
            self.compressors[LAST_LAYER] = build(EXACT)
        #: the reduction of a bucket whose parameters fall into several of these groups
        self.composite = Composite(self.key_for, self.compressors)

    @property
    def rounds(self) -> int:
        """Collectives one bucket may need: its groups run one after another."""
        return self.composite.rounds

    def key_for(self, name: str) -> str:
        """The group of the parameter called ``name`` (the first matching override wins)."""
        key = next((f"override{i}" for i, ov in enumerate(self.config.overrides) if ov.matches(name)), MAIN)
        return LAST_LAYER if key in self.skipping and name in self.last_layer else key

    def replace(self, key: str, compressor: Compressor, spec: tuple[str, dict[str, Any]]) -> None:
        """Run group ``key`` with ``compressor``, built from ``spec`` = (method, params), from now on."""
        self.compressors[key] = compressor
        self.specs[key] = spec

    def end_step(self, commit: bool) -> None:
        """Commit (or, for a non-finite step, discard) every group's staged state."""
        for compressor in self.compressors.values():
            compressor.end_step(commit)

    def state_dict(self) -> dict[str, Any]:
        return {key: c.state_dict() for key, c in self.compressors.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, c in self.compressors.items():
            c.load_state_dict(state.get(key, {}))

    def shared(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` (a :meth:`state_dict`) without the per-rank entries: what every rank shares."""
        return {key: without_per_rank(self.compressors[key], s) for key, s in state.items()}


def last_layer_names(model: nn.Module) -> list[str]:
    """The parameter names of the last module (in ``named_modules()`` order) holding parameters of
    its own: a classifier's weight and bias; a weight tied to an earlier module keeps its name."""
    own: list[nn.Parameter] = []
    for _, module in model.named_modules():
        here = list(module.parameters(recurse=False))
        if here:
            own = here
    ids = {id(p) for p in own}
    return [name for name, p in model.named_parameters() if id(p) in ids]
