"""A layer-wise plan as data: each planned tensor's setting, by label, and its bytes; what
planning has cost (:mod:`commpress.layerwise.groups` makes and applies plans)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from commpress.compressors import Setting, compressor_class
from commpress.config import digest_of
from commpress.terminal import format_table

__all__ = ["LayerPlan", "PlanningCost", "label"]


def label(setting: Setting) -> str:
    """``"topk ratio=0.02"``, ``"powersgd rank=8"``, ``"none"``: a setting by its method's
    :attr:`~commpress.compressors.base.Compressor.knob`."""
    method, params = setting
    knob = compressor_class(method).knob
    return f"{method} {knob}={params[knob]:g}" if knob in params else method


@dataclass(frozen=True)
class LayerPlan:
    """Each planned tensor's group key, label and bytes per step, the budget, the summed error, the
    step the plan took effect, and the ranks holding it (a bandwidth cross group; empty: all)."""

    step: int
    keys: dict[str, str]
    labels: dict[str, str]
    nbytes: dict[str, float]
    budget: float
    error: float
    ranks: tuple[int, ...] = ()

    @property
    def total_bytes(self) -> float:
        return sum(self.nbytes.values())

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for digests and checkpoints."""
        return {**dataclasses.asdict(self), "ranks": list(self.ranks)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerPlan:
        return cls(
            int(data["step"]),
            dict(data["keys"]),
            dict(data["labels"]),
            {k: float(v) for k, v in data["nbytes"].items()},
            float(data["budget"]),
            float(data["error"]),
            tuple(int(r) for r in data.get("ranks", ())),
        )

    def digest(self) -> str:
        return digest_of(self.to_dict())

    def __str__(self) -> str:
        rows = [[name, self.labels[name], f"{self.nbytes[name]:,.0f}"] for name in self.keys]
        where = f" of ranks {' '.join(map(str, self.ranks))}" if self.ranks else ""
        head = f"layer-wise plan{where} from step {self.step}: {self.total_bytes:,.0f} of {self.budget:,.0f} bytes per step"
        return head + "\n" + format_table(["tensor", "setting", "bytes/step"], rows)


@dataclass
class PlanningCost:
    """What layer-wise planning has cost this rank, in wall seconds: measuring on measured steps,
    and making plans (the collectives and their waits, the solve, the switch). A diagnostic for
    ``commpress bench``, not training state, so not in ``state_dict()``."""

    measured_steps: int = 0
    measure_seconds: float = 0.0
    plans: int = 0
    plan_seconds: float = 0.0

    def snapshot(self) -> dict[str, float]:
        return dataclasses.asdict(self)
