"""The traffic model: what each group of a hierarchical reduction sends per step and how long that
takes, predicted from the measured topology. One rank's *payload* is its collective's input (what
``Traffic`` counts); for b bytes over n ranks, gloo's algorithms send on the wire:

- ring all-reduce: ``2(n-1)/n * b`` in ``2(n-1)`` messages;
- ring all-gather (b from every rank): ``(n-1) * b`` in ``n-1`` messages;
- all-to-all (n chunks): ``(n-1)/n * b`` in ``n-1`` messages.

W wire bytes in M messages over links of latency ``alpha`` and per-flow rate ``beta`` take
``t = M alpha + W / beta``. A shaped link's token bucket of ``b`` bytes passes ``b`` at line rate
after the pause between steps and refills (by at most ``b``) during each message's latency:
``t = M alpha + max(0, W - b - M min(b, beta alpha)) / beta``.

The compressor reports its collectives (:meth:`~commpress.compressors.base.Compressor.transfers`),
else it is run once on the simulated world.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from commpress.bandwidth.hierarchical import Place, shard_ranges, shard_slots
from commpress.bandwidth.hierarchy import Hierarchy
from commpress.bandwidth.topology import Topology
from commpress.comm.simulated import SimulatedWorld
from commpress.compressors import EXACT, Bucket, Context, ParamSlot, Transfer, build, lay_out
from commpress.compressors.wire.collectives import relayed
from commpress.config.groups import MAIN

__all__ = [
    "GroupTraffic",
    "Link",
    "ModelLayout",
    "Transfer",
    "cross_link",
    "cross_traffic",
    "ddp_buckets",
    "domain_link",
    "domain_traffic",
    "group_shapes",
    "method_transfers",
    "predict",
]

Methods = Mapping[str, tuple[str, Mapping[str, Any]]]
_MIB = 1024 * 1024


@dataclass(frozen=True)
class Link:
    """The links of one group as a collective sees them: ``bandwidth`` of one rank's flow
    (bytes/s), ``latency`` per message (s), ``burst`` (bytes: the token bucket of a shaped link)."""

    bandwidth: float
    latency: float = 0.0
    burst: float = 0.0

    def seconds(self, transfers: Sequence[Transfer], n: int) -> float:
        """Seconds of the transfers of one step (see the module's docstring)."""
        wire = sum(t.wire_bytes(n) for t in transfers)
        messages = sum(t.messages(n) for t in transfers)
        free = self.burst + messages * min(self.burst, self.bandwidth * self.latency)
        return messages * self.latency + max(0.0, wire - free) / self.bandwidth


@dataclass(frozen=True)
class GroupTraffic:
    """What each rank of one group sends per step (``transfers``) over ``link``."""

    name: str
    scope: str
    ranks: tuple[int, ...]
    transfers: tuple[Transfer, ...]
    link: Link

    @property
    def payload_bytes(self) -> float:
        """Input bytes of the rank's collectives per step (what ``Traffic`` counts)."""
        return sum(t.nbytes for t in self.transfers)

    @property
    def wire_bytes(self) -> float:
        return sum(t.wire_bytes(len(self.ranks)) for t in self.transfers)

    @property
    def seconds(self) -> float:
        return self.link.seconds(self.transfers, len(self.ranks))

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.name,
            "ranks": list(self.ranks),
            "bytes": self.payload_bytes,
            "wire_bytes": self.wire_bytes,
            "seconds": self.seconds,
        }


# what a method sends


def method_transfers(
    method: str, params: Mapping[str, Any], slots: Sequence[ParamSlot], element_size: int = 4, group_size: int = 2
) -> tuple[Transfer, ...]:
    """The collectives ``method`` with ``params`` issues for ``slots`` among ``group_size`` ranks."""
    return _cached(method, json.dumps(dict(params), sort_keys=True), tuple(slots), element_size, group_size)


@functools.lru_cache(maxsize=4096)
def _cached(method: str, params: str, slots: tuple[ParamSlot, ...], element_size: int, n: int) -> tuple[Transfer, ...]:
    if not slots or not sum(s.numel for s in slots):
        return ()
    kwargs = json.loads(params)
    modelled = build(method, kwargs).transfers(slots, element_size)
    if modelled is None:
        return tuple(_dry_run(method, kwargs, slots, element_size, n))
    return tuple(t for t in modelled if t.nbytes)


def _dry_run(method: str, params: Mapping[str, Any], slots: tuple[ParamSlot, ...], element_size: int, n: int) -> list[Transfer]:
    """Run ``method`` once on ``n`` in-process ranks (random gradients) and record rank 0's collectives."""
    dtype = {2: torch.float16, 4: torch.float32, 8: torch.float64}[element_size]
    total = max(s.offset + s.numel for s in slots)
    gen = torch.Generator().manual_seed(0)
    buckets = [Bucket(0, torch.randn(total, generator=gen).to(dtype), slots) for _ in range(n)]
    seen: list[Any] = []
    reductions = [build(method, params).reduce(b, Context(rank=r, world_size=n, step=0)) for r, b in enumerate(buckets)]
    SimulatedWorld(n).run([relayed(reductions[0], after=lambda request, _: seen.append(request)), *reductions[1:]])
    return [Transfer.of(req) for req in seen if req.nbytes]


# the model's buckets and the hierarchical layout


@dataclass(frozen=True)
class ModelLayout:
    """What a model reduces each step: DDP's ``buckets`` of slots, each parameter's method group
    (``keys``; absent: the main method) and the gradients' ``element_size`` in bytes."""

    buckets: tuple[tuple[ParamSlot, ...], ...]
    keys: dict[str, str] = field(default_factory=dict)
    element_size: int = 4

    def parts(self, slots: Sequence[ParamSlot]) -> list[tuple[str, tuple[ParamSlot, ...]]]:
        """``slots`` split by method group, packed from 0, as :meth:`~commpress.config.groups.MethodGroups.parts` does."""
        groups: dict[str, list[ParamSlot]] = {}
        for s in slots:
            groups.setdefault(self.keys.get(s.name, MAIN), []).append(s)
        return [(key, lay_out((s.name, s.shape) for s in members)[0]) for key, members in groups.items()]


def ddp_buckets(
    named_shapes: Sequence[tuple[str, Sequence[int]]],
    element_size: int = 4,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
) -> tuple[tuple[ParamSlot, ...], ...]:
    """DDP's buckets after its first step with its defaults: gradients in reverse registration order,
    the first bucket closed at ``first_bucket_mb`` MiB, later ones at ``bucket_cap_mb``."""
    buckets: list[list[tuple[str, Sequence[int]]]] = []
    current: list[tuple[str, Sequence[int]]] = []
    size, limit = 0, first_bucket_mb * _MIB
    for name, shape in reversed(named_shapes):
        current.append((name, shape))
        size += math.prod(shape) * element_size
        if size >= limit:
            buckets.append(current)
            current, size, limit = [], 0, bucket_cap_mb * _MIB
    if current:
        buckets.append(current)
    return tuple(lay_out(b)[0] for b in buckets)


def _shard_parts(layout: ModelLayout, place: Place) -> list[tuple[str, tuple[ParamSlot, ...]]]:
    """(method group, slots) of this place's shard of every bucket, as the hierarchical reduction cuts it."""
    out = []
    for slots in (b for b in layout.buckets if b):
        start, stop = shard_ranges(slots, max(s.offset + s.numel for s in slots), place.shards)[place.local_rank]
        out += layout.parts(shard_slots(slots, start, stop))
    return out


def _domain_transfers(slots: Sequence[ParamSlot], place: Place, element_size: int) -> list[Transfer]:
    """A bucket's all-to-all of ``k`` chunks as wide as the widest shard, and all-gather of one."""
    k = place.domain_size
    if k == 1 or not slots:
        return []
    ranges = shard_ranges(slots, max(s.offset + s.numel for s in slots), place.shards)
    width = max(b - a for a, b in ranges) * element_size
    return [Transfer("all_to_all", k * width), Transfer("all_gather", width)]


def group_shapes(layout: ModelLayout, hierarchy: Hierarchy, group: int, key: str) -> list[tuple[int, ...]]:
    """Shapes of the tensors (or cut 1-D pieces) cross group ``group`` reduces with method group ``key``."""
    place = Place.of(hierarchy, hierarchy.cross_groups[group][0])
    return [tuple(s.shape) for k, part in _shard_parts(layout, place) if k == key for s in part]


def _pairs(topology: Topology, ranks: Sequence[int]) -> Link:
    """A collective over ``ranks`` alone: its slowest link, its largest latency."""
    pairs = [(i, j) for i in ranks for j in ranks if i != j]
    if not pairs:
        return Link(math.inf)
    return Link(min(topology.bandwidth[i][j] for i, j in pairs), max(topology.latency[i][j] for i, j in pairs))


def cross_link(topology: Topology, hierarchy: Hierarchy, group: int) -> Link:
    """Cross group ``group``'s links: its slowest pair, and each domain's measured uplink shared by all."""
    link = _pairs(topology, hierarchy.cross_groups[group])
    shared = [f for f in topology.uplinks if f.rates]
    if not shared:
        return link
    flows = hierarchy.shards
    rate = min(link.bandwidth, *(f.total / flows for f in shared))
    return Link(rate, link.latency, min(f.burst / flows for f in shared))


def domain_link(topology: Topology, hierarchy: Hierarchy, domain: int) -> Link:
    """Domain ``domain``'s links: its slowest pair, and where measured, its slowest flow with all sending."""
    link = _pairs(topology, hierarchy.domains[domain])
    flows = topology.domain_links[domain] if topology.domain_links else None
    if flows is None or not flows.rates:
        return link
    return Link(min(link.bandwidth, *flows.rates), link.latency, flows.burst / len(flows.rates))


def cross_traffic(topology: Topology, hierarchy: Hierarchy, layout: ModelLayout, group: int, methods: Methods) -> GroupTraffic:
    """Cross group ``group`` running ``methods`` ({method group: (method, params)}) on its shards."""
    ranks = hierarchy.cross_groups[group]
    place = Place.of(hierarchy, ranks[0])
    transfers: list[Transfer] = []
    for key, part in _shard_parts(layout, place):
        method, params = methods.get(key, (EXACT, {}))
        transfers += method_transfers(method, params, part, layout.element_size, len(ranks))
    return GroupTraffic(f"cross {group}", "cross", ranks, tuple(transfers), cross_link(topology, hierarchy, group))


def domain_traffic(topology: Topology, hierarchy: Hierarchy, layout: ModelLayout, domain: int) -> GroupTraffic:
    """Domain ``domain``'s uncompressed reduce-scatter and all-gather of every bucket."""
    ranks = hierarchy.domains[domain]
    place = Place.of(hierarchy, ranks[0])
    transfers = [t for slots in layout.buckets for t in _domain_transfers(slots, place, layout.element_size)]
    return GroupTraffic(f"domain {domain}", "domain", ranks, tuple(transfers), domain_link(topology, hierarchy, domain))


def predict(
    topology: Topology, hierarchy: Hierarchy, layout: ModelLayout, methods: Sequence[Methods]
) -> tuple[GroupTraffic, ...]:
    """Every group's traffic per step: the cross groups (``methods[j]`` for group j), then the domains."""
    cross = [cross_traffic(topology, hierarchy, layout, j, m) for j, m in enumerate(methods)]
    return (*cross, *(domain_traffic(topology, hierarchy, layout, d) for d in range(len(hierarchy.domains))))
