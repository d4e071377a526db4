"""The bandwidth-aware layer of the DDP hook state (``[bandwidth] adaptive = true``).

At start-up it measures the links (:func:`~commpress.bandwidth.measurement.measure_topology`), plans
(:func:`~commpress.bandwidth.planner.plan_hierarchy`), checks that every rank holds the same plan,
then reduces every bucket hierarchically; with ``remeasure_every`` it measures and plans again every
N-th step, before any bucket is in flight. A method whose parameter changes keeps its state
(:func:`~commpress.bandwidth.ratios.adapt_state`); a group switched to ``none`` parks its compressor
until a plan brings it back. With ``[layerwise]`` the main method's setting is the link's budget,
which a layer-wise plan per cross group shares out per tensor (:mod:`commpress.layerwise.groups`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from commpress.bandwidth import timing
from commpress.bandwidth.hierarchical import Place, hierarchical_reduction, hierarchy_scopes
from commpress.bandwidth.measurement import measure_topology
from commpress.bandwidth.planner import HierarchyPlan, plan_hierarchy
from commpress.bandwidth.ratios import adapt_state
from commpress.bandwidth.topology import Topology
from commpress.bandwidth.traffic import ModelLayout, ddp_buckets
from commpress.comm import Backend
from commpress.comm.links import MeasurableBackend
from commpress.compressors import Bucket, Compressor, ParamSlot, build
from commpress.config import digest_of
from commpress.config.groups import MethodGroups
from commpress.config.tables import BandwidthConfig
from commpress.errors import CollectiveError, ConfigError

__all__ = ["AdaptiveLayer"]


class AdaptiveLayer:
    """Measure, plan and run hierarchical reductions of ``groups``' buckets over ``main``'s ranks and traffic."""

    def __init__(self, groups: MethodGroups, settings: BandwidthConfig, model: torch.nn.Module | None, main: Backend) -> None:
        if model is None:
            raise ConfigError("[bandwidth] adaptive = true needs the model (pass model= to CommState) to size the plan")
        if not isinstance(main, MeasurableBackend):
            raise ConfigError(f"[bandwidth] adaptive = true needs a backend that can measure links, got {type(main).__name__}")
        self.settings = settings
        self._groups = groups
        self._main = main
        self._links = main.links()  # a communicator of its own: probes never mix with reductions
        self.configured = {key: (m, dict(p)) for key, (m, p) in groups.specs.items()}
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        element_size = trainable[0][1].element_size() if trainable else 4
        self.layout = ModelLayout(
            ddp_buckets([(name, tuple(p.shape)) for name, p in trainable], element_size),
            {name: groups.key_for(name) for name, _ in trainable},
            element_size,
        )
        self._seen: dict[int, tuple[ParamSlot, ...]] = {}  # the buckets of the step in progress
        self._seen_step: int | None = None
        self._steps_seen = 0
        self.log = timing.active()
        if self.log is not None:
            self.log.layer = self
        # switching between the configured method and none (1 round) needs no more rounds than the groups'
        self.rounds = groups.rounds
        self.active: dict[str, tuple[str, dict[str, Any]]] = {key: (m, dict(p)) for key, (m, p) in self.configured.items()}
        self.parked: dict[tuple[str, str], Compressor] = {}
        self.parked_params: dict[tuple[str, str], dict[str, Any]] = {}
        self.topology: Topology | None = None
        self.plan: HierarchyPlan | None = None
        self.backend: Backend | None = None
        self.place: Place | None = None
        self.history: list[dict[str, Any]] = []  # (step, plan) of every plan, for logs and tests
        self.replan(self.measure(), step=0)

    @property
    def domain_traffic(self):
        """Uncompressed bytes this rank sent inside its domain."""
        return self.backend.domain_traffic

    def measure(self) -> Topology:
        """Measure the links now (all ranks together; nothing may be in flight)."""
        s, links = self.settings, self._links
        try:
            domains = s.domains or None
            return measure_topology(links, probe_ms=s.probe_ms, fast_gbps=s.fast_gbps, group_by=s.group_by, domains=domains)
        except RuntimeError as exc:
            ranks = list(links.ranks)
            raise CollectiveError(f"measuring the links over ranks {ranks} failed on rank {ranks[links.rank]}: {exc}") from exc

    def begin_step(self, step: int) -> None:
        """Called before the first bucket of ``step``: re-measure and re-plan if due."""
        every = self.settings.remeasure_every
        if every and step > 0 and step % every == 0:
            self.replan(self.measure(), step)

    def replan(self, topology: Topology, step: int | None = None) -> HierarchyPlan:
        """Plan from ``topology`` and switch to it; every rank must pass the same one (RuntimeError if not)."""
        self.layout = self.observed_layout()
        plan = plan_hierarchy(topology, self.layout, self.configured, self.settings)
        digests = self._links.allgather_object(digest_of(plan.to_dict()))
        if len(set(digests)) > 1:
            raise RuntimeError(f"ranks planned differently (plan digests {digests}); every rank must plan from the same topology")
        if self.plan is None or plan.domains != self.plan.domains:
            world = self._main.world_size
            if plan.world_size != world:
                raise ValueError(f"plan is for {plan.world_size} ranks, the process group has {world}")
            rounds = {"domain": 2, "cross": self.rounds}
            self.backend = self._main.scoped(rounds, hierarchy_scopes(plan, world))
            self.backend.traffic = self._main.traffic
        self.place = Place.of(plan, self._main.rank)
        self.topology, self.plan = topology, plan
        if self.place.cross_rank is not None:  # else this rank compresses nothing: keep whatever it holds
            for key, (method, params) in plan.methods[self.place.local_rank].items():
                self._switch(key, method, dict(params))
        self.history.append({"step": step, "plan": plan.to_dict(), "active": self._spec()})
        return plan

    def observed_layout(self) -> ModelLayout:
        """The buckets of the last step once DDP has rebuilt them (after its first); until then the planned ones."""
        if self._steps_seen < 2 or not self._seen:
            return self.layout
        return ModelLayout(tuple(self._seen[i] for i in sorted(self._seen)), self.layout.keys, self.layout.element_size)

    def _switch(self, key: str, method: str, params: dict[str, Any]) -> None:
        """Make ``key`` use ``method`` with ``params``, carrying the method's state over."""
        if self.active[key] == (method, params):
            return
        old_method, old_params = self.active[key]
        self.parked[key, old_method], self.parked_params[key, old_method] = self._groups.compressors[key], old_params
        new = build(method, params)
        previous = self.parked.pop((key, method), None)
        previous_params = self.parked_params.pop((key, method), None)
        if previous is not None:
            new.load_state_dict(adapt_state(method, previous.state_dict(), previous_params, params))
        self._groups.replace(key, new, (method, params))
        self.active[key] = (method, params)

    def _spec(self) -> dict[str, list[Any]]:
        return {key: [m, dict(sorted(p.items()))] for key, (m, p) in self.active.items()}

    def run(self, bucket: Bucket, step: int) -> torch.futures.Future:
        """Reduce one bucket hierarchically (see :func:`hierarchical_reduction`)."""
        if step != self._seen_step:
            self._seen, self._seen_step, self._steps_seen = {}, step, self._steps_seen + 1
        self._seen[bucket.index] = tuple(bucket.slots)
        reduction = hierarchical_reduction(bucket, step, self.place, self._groups.composite.reduce)
        if self.log is not None:
            reduction = self.log.wrap(reduction, step, bucket.index)
        return self.backend.run(reduction, bucket.buffer.device)

    def state_dict(self) -> dict[str, Any]:
        """The topology the plan came from, the active methods, the parked states."""
        return {
            "topology": self.topology.to_dict(),
            "active": self._spec(),
            "parked": [
                [key, method, self.parked_params[key, method], c.state_dict()] for (key, method), c in self.parked.items()
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Return to the saved plan (no measurement) with the saved compressors; the
        active compressors' own states are loaded by CommState afterwards."""
        self.replan(Topology.from_dict(state["topology"]))
        for key, (method, params) in state["active"].items():
            self._switch(key, method, dict(params))
        self.parked, self.parked_params = {}, {}
        for key, method, params, sd in state["parked"]:
            c = build(method, params)
            c.load_state_dict(sd)
            self.parked[key, method], self.parked_params[key, method] = c, dict(params)
