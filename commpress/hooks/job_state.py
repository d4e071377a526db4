"""The questions :func:`commpress.comm.checkpoint.own_part` asks of a hook state reading its part
of a whole-job checkpoint."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from commpress.comm import checkpoint
from commpress.config.groups import MethodGroups
from commpress.errors import ConfigError
from commpress.layerwise.groups import LayerwiseGroups

__all__ = ["JobState"]


class JobState:
    """Whole-job checkpoint questions for a hook state's method ``groups`` and ``layerwise`` plan."""

    def __init__(self, groups: MethodGroups, layerwise: LayerwiseGroups | None, rank: int, world_size: int) -> None:
        self.groups, self.layerwise, self.rank, self.world_size = groups, layerwise, rank, world_size

    def holds_per_rank(self, part: Mapping[str, Any]) -> bool:
        """Whether ``part`` holds entries that belong to the rank that saved it alone."""
        parked = part.get("adaptive", {}).get("parked")
        if self.layerwise is not None and self.layerwise.holds_per_rank(part.get("layerwise", {})):
            return True
        return bool(parked) or checkpoint.compressors_per_rank(self.groups.compressors, part["compressors"])

    def combine(self, shared: Mapping[str, Any], parts: Sequence[Mapping[str, Any]], scale: float) -> dict[str, Any]:
        """This rank's part from the saved ``parts`` of a job of another world size; a bandwidth
        layer's plan, measured for that job's links, is refused."""
        if "adaptive" in shared:
            raise ConfigError(
                f"this job has {self.world_size} ranks, the state was saved by {shared['world_size']}: the "
                "bandwidth layer's plan was measured for that job's links; resume it with the same world size, or "
                "without the saved state (the layer measures again)"
            )
        combined = [p["compressors"] for p in parts]
        compressors = checkpoint.combine_compressors(self.groups.compressors, shared["compressors"], combined, scale)
        out = {**shared, "rank": self.rank, "world_size": self.world_size, "compressors": compressors}
        if self.layerwise is not None:
            out["layerwise"] = self.layerwise.combine_plan_states(shared["layerwise"], [p["layerwise"] for p in parts], scale)
        return out
