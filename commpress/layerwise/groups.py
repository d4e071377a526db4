"""Layer-wise compression (``[layerwise] enabled = true``, L-GreCo): each tensor of the main
method gets the setting that measured errors and a byte budget choose.

Every ``every`` steps from ``start_iter`` on, each rank measures while reducing what every
candidate setting (:mod:`commpress.layerwise.measure`) would lose on each tensor; at the next
step's first bucket the ranks sum their errors, solve the knapsack, check by a digest that they
hold one plan, and switch. Every candidate is a method group of its own (``main``, then
``main@<setting>``), built up front so the backend's channels are known when it opens; a tensor
changing group takes its state along (:meth:`~commpress.compressors.base.Compressor.adapt_state`
within a method, else what it owes is added to its next gradient).

Under the bandwidth layer (``[bandwidth] adaptive = true``) a plan is made per link: errors are
measured on what crosses it and summed over its cross group, and ``"uniform"`` is the bytes of
the setting the bandwidth plan gives ``main``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from commpress.comm import Backend
from commpress.comm.checkpoint import sum_entries
from commpress.compressors import EXACT, AllReduce, Bucket, Compressor, Context, ParamSlot, Reduction, Setting, build, host
from commpress.compressors.composite import Composite
from commpress.compressors.wire.collectives import in_scope
from commpress.config import Config
from commpress.config.groups import MAIN, MethodGroups
from commpress.config.tables import LayerwiseConfig
from commpress.errors import ConfigError
from commpress.layerwise.knapsack import cheapest, solve
from commpress.layerwise.measure import candidates, tensor_errors
from commpress.layerwise.plan import LayerPlan, PlanningCost, label

__all__ = ["LayerwiseGroups", "method_groups"]

log = logging.getLogger("commpress.layerwise")


def method_groups(config: Config, model: nn.Module | None = None, last_layer: Iterable[str] | None = None) -> MethodGroups:
    """The method groups of ``config``: planned per tensor when its ``[layerwise]`` table is enabled."""
    settings = config.section("layerwise")
    if settings is not None and settings.enabled:
        return LayerwiseGroups(config, model, last_layer)
    return MethodGroups(config, model, last_layer)


@dataclass
class _Measured:
    """One tensor's measured errors (one per candidate) and what prices its settings."""

    shape: tuple[int, ...]
    element_size: int
    errors: list[float]


class LayerwiseGroups(MethodGroups):
    """:class:`MethodGroups` whose main method is set per tensor by a measured plan (the
    module docstring says how). ``plan`` is the plan in force (None until the first)."""

    def __init__(self, config: Config, model: nn.Module | None = None, last_layer: Iterable[str] | None = None) -> None:
        self.assigned: dict[str, str] = {}  # tensor -> group key, for the planned tensors
        super().__init__(config, model, last_layer)
        self.settings: LayerwiseConfig = config.section("layerwise")
        bandwidth = config.section("bandwidth")
        #: one plan per link of the bandwidth layer (module docstring)
        self.per_link = bandwidth is not None and bandwidth.adaptive
        settings = candidates(*self.specs[MAIN])
        #: group key -> setting, every candidate (``main`` the one in force: configured, or the bandwidth plan's)
        self.candidates: dict[str, Setting] = {MAIN: settings[0], **{f"{MAIN}@{label(s)}": s for s in settings[1:]}}
        self.compressors.update({key: build(*s) for key, s in self.candidates.items() if key != MAIN})
        self.composite = _Planned(self)
        self.plan: LayerPlan | None = None
        self._carry: dict[str, torch.Tensor] = {}  # tensor -> what it owes its next gradient (per rank)
        self._consumed: set[str] = set()  # carries added to this step's gradients
        self._measured: dict[str, _Measured] = {}  # committed: the next plan's input
        self._staged: dict[str, _Measured] = {}  # measured in the step in progress
        self._states: dict[str, dict[str, Any]] | None = None  # committed compressor states, while measuring
        #: plans follow the step index, and a dropped step undoes its plan
        self.by_step = False
        #: every planned tensor of the model: name -> (shape, element size)
        self.tensors = {
            n: (tuple(p.shape), p.element_size())
            for n, p in (model.named_parameters() if model is not None else ())
            if p.requires_grad and p.numel() and self.planned(n)
        }
        self._undo: tuple[dict[str, Any], dict[str, dict[str, Any]]] | None = None  # before this step's plan
        #: what measuring and planning have cost this rank
        self.cost = PlanningCost()

    def planned(self, name: str) -> bool:
        """Whether the plan sets the tensor called ``name`` (the main method's tensors)."""
        return super().key_for(name) == MAIN

    def key_for(self, name: str) -> str:
        key = super().key_for(name)
        return self.assigned.get(name, MAIN) if key == MAIN else key

    def measuring(self, step: int) -> bool:
        """Whether ``step``'s gradients are measured for the next plan (never on a link sent exactly)."""
        start = self.config.start_iter
        exact = self.compressors[MAIN].name == EXACT
        return step >= start and (step - start) % self.settings.every == 0 and not exact

    def replace(self, key: str, compressor: Compressor, spec: Setting) -> None:
        """The bandwidth layer's new setting for ``key``; a new ``main`` ends the plan made for the
        old one: every tensor back to ``main``, its state carried, a waiting measurement dropped."""
        super().replace(key, compressor, spec)
        if key != MAIN:
            return
        self.candidates[MAIN] = spec
        if self.plan is not None:
            log.info("main is now %s: the layer-wise plan from step %d ends with its budget", label(spec), self.plan.step)
        self._move({n: (k, MAIN) for n, k in sorted(self.assigned.items()) if k != MAIN})
        self.assigned, self.plan, self._measured = {}, None, {}
        self.composite = _Planned(self)

    def prepare(self, bucket: Bucket, ctx: Context) -> None:
        """Before a bucket is reduced: add what moved tensors owe to their gradients, and
        measure the candidates on a measured step."""
        momentum = self.compressors[MAIN].momentum
        for c in self.compressors.values():  # the momentum handed over to the configured group
            if c.applies_momentum and c.momentum is None:
                c.momentum = momentum
        for slot in bucket.slots:
            carry = self._carry.get(slot.name)
            if carry is not None and slot.name not in self._consumed:
                view = bucket.buffer.narrow(0, slot.offset, slot.numel)
                view.add_(carry.to(view.device).reshape(-1))
                self._consumed.add(slot.name)
        if not self.measuring(ctx.step):
            return
        t0 = time.perf_counter()
        if self._states is None:
            self._states = {key: self.compressors[key].state_dict() for key in self.candidates}
            self.cost.measured_steps += 1
        order = [self.compressors[key] for key in self.candidates]
        for slot in bucket.slots:
            if not slot.numel or not self.planned(slot.name):
                continue
            acc = bucket.buffer.narrow(0, slot.offset, slot.numel).to(torch.float32, copy=True)
            key = self.key_for(slot.name)
            entries = {sk: d[slot.name] for sk, d in self._states[key].items() if isinstance(d, dict) and slot.name in d}
            extra = self.compressors[key].owed(entries)  # what the tensor's committed state entries owe
            if extra is not None:
                acc.add_(extra.to(acc.device).reshape(-1))
            errors = tensor_errors(order, tuple(slot.shape), acc)
            self._staged[slot.name] = _Measured(tuple(slot.shape), bucket.buffer.element_size(), errors)
        self.cost.measure_seconds += time.perf_counter() - t0

    def end_step(self, commit: bool) -> None:
        super().end_step(commit)
        if commit:
            for name in self._consumed:
                self._carry.pop(name, None)
            self._measured.update(self._staged)
        self._consumed, self._staged, self._states = set(), {}, None
        undo, self._undo = self._undo, None
        if undo is not None and not commit:
            self.load_plan_state(undo[0])
            for key, state in undo[1].items():
                self.compressors[key].load_state_dict(state)

    @property
    def waiting(self) -> bool:
        """Whether a measured step waits for its plan (made at the next step's first bucket)."""
        return bool(self._measured)

    def due(self, step: int) -> bool:
        """Whether ``step`` plans at its first bucket: a measurement waits; with
        :attr:`by_step`, the step before was measured."""
        return self.measuring(step - 1) if self.by_step else self.waiting

    def hold(self) -> None:
        """Keep what a plan changes (plan, carries, measurement, the candidates' committed
        states) until the step ends: :meth:`end_step` restores it if the step is dropped."""
        self._undo = (self.plan_state(), {key: self.compressors[key].state_dict() for key in self.candidates})

    def replan(self, backend: Backend, step: int, device: torch.device) -> bool:
        """At the first bucket of ``step``: plan if a measurement waits (nothing may be in flight);
        whether it planned. Per link, ``backend`` is the bandwidth layer's, planning over the cross group."""
        if not self.due(step):
            return False
        if not backend.can_block:
            raise ConfigError(
                "[layerwise] plans with collectives a hook must wait for: it needs ranks in separate processes "
                "(a torch.distributed or MPI backend)"
            )
        if self.by_step:
            self.hold()
        t0 = time.perf_counter()
        if self.per_link:
            backend.run(in_scope(self.planning(step, device, tuple(backend.members("cross"))), "cross")).wait()
        else:
            backend.run(self.planning(step, device)).wait()
        self.cost.plans += 1
        self.cost.plan_seconds += time.perf_counter() - t0
        return True

    def planning(self, step: int, device: torch.device, ranks: tuple[int, ...] = ()) -> Reduction:
        """The plan as a reduction: sum the ranks' errors, solve, compare digests, switch; on ``device``,
        the buckets' (an NCCL-only group takes no host tensor). ``ranks``: the participants, when not
        every rank. With :attr:`by_step` every tensor is planned, unmeasured ones at zero error."""
        if self.by_step:
            unknown = sorted(set(self._measured) - set(self.tensors))
            if unknown:
                raise RuntimeError(f"[layerwise] measured tensors the model does not plan: {unknown}")
            for name, (shape, size) in self.tensors.items():
                self._measured.setdefault(name, _Measured(shape, size, [0.0] * len(self.candidates)))
        names = sorted(self._measured)
        errors = torch.tensor([self._measured[n].errors for n in names], dtype=torch.float64, device=device)
        summed = yield AllReduce(errors)
        totals = host.numbers(summed)
        width = len(self.candidates)
        rows = [totals[i * width : (i + 1) * width] for i in range(len(names))]
        plan = dataclasses.replace(self.solve(names, rows, step), ranks=ranks)
        mine = float(int(plan.digest()[:12], 16))  # 48 bits: exact in float64
        digest = torch.tensor([mine, -mine], dtype=torch.float64, device=device)
        seen = yield AllReduce(digest.clone(), op="max")
        if not host.flags((seen == digest).all())[0]:
            raise RuntimeError(f"ranks planned differently (this rank's plan digest {plan.digest()}): {plan}")
        self._measured = {}
        self.apply(plan)

    def sharing(self, healing: bool, device: torch.device) -> Reduction:
        """Hand the plan in force to a replica healing in this step, whose own is stale: each tensor's
        group, the maximum over the participants (a healer's counts as nothing; kept as :meth:`hold`
        keeps a plan); the participants, whose plans must agree, keep theirs."""
        keys, names = list(self.candidates), sorted(self.tensors)
        mine = torch.tensor([float(keys.index(self.key_for(n))) for n in names], dtype=torch.float64, device=device)
        seen = yield AllReduce(mine.clone(), op="max")
        if healing:
            self.hold()
            self.assigned = {n: keys[int(i)] for n, i in zip(names, host.numbers(seen))}
            self.composite = _Planned(self)
        elif not host.flags((seen == mine).all())[0]:
            raise RuntimeError(f"the participants hold different layer-wise plans (this one's: {self.plan})")

    def solve(self, names: Sequence[str], errors: Sequence[Sequence[float]], step: int) -> LayerPlan:
        """The plan for ``names`` (tensors measured, sorted) from their summed ``errors``."""
        keys = list(self.candidates)
        slots = [ParamSlot(n, torch.Size(self._measured[n].shape), 0) for n in names]
        sizes = [self._measured[n].element_size for n in names]
        costs = [[_bytes(self.compressors[k], s, e) for k in keys] for s, e in zip(slots, sizes)]
        budget = self.budget(slots, sizes)
        choice = solve(costs, errors, budget) or cheapest(costs)
        return LayerPlan(
            step,
            {n: keys[c] for n, c in zip(names, choice)},
            {n: label(self.candidates[keys[c]]) for n, c in zip(names, choice)},
            {n: costs[i][c] for i, (n, c) in enumerate(zip(names, choice))},
            budget,
            sum(errors[i][c] for i, c in enumerate(choice)),
        )

    def budget(self, slots: Sequence[ParamSlot], sizes: Sequence[int]) -> float:
        """Bytes per step the plan may spend on ``slots`` (``[layerwise] budget``)."""
        budget = self.settings.budget
        if budget == "uniform":
            return sum(_bytes(self.compressors[MAIN], s, e) for s, e in zip(slots, sizes))
        if isinstance(budget, float):
            return budget * sum(4 * s.numel for s in slots)
        return float(budget)

    def apply(self, plan: LayerPlan) -> None:
        """Switch to ``plan``, carrying every moved tensor's state (module docstring)."""
        self._move({n: (self.key_for(n), k) for n, k in plan.keys.items() if self.key_for(n) != k})
        changed = self.plan is None or plan.labels != self.plan.labels
        self.assigned, self.plan = dict(plan.keys), plan
        self.composite = _Planned(self)  # the parts of every bucket change
        if changed:
            log.info("%s", plan)

    def _move(self, moves: Mapping[str, tuple[str, str]]) -> None:
        touched = sorted({k for pair in moves.values() for k in pair})
        states = {k: self.compressors[k].state_dict() for k in touched}
        for name, (old, new) in sorted(moves.items()):
            entries = {sk: d.pop(name) for sk, d in states[old].items() if isinstance(d, dict) and name in d}
            source, target = self.compressors[old], self.compressors[new]
            if entries and target.takes_state_of(source):
                adapted = target.adapt_state({sk: {name: v} for sk, v in entries.items()}, source)
                for sk, d in adapted.items():
                    states[new].setdefault(sk, {}).update(d)
                continue
            debt = source.owed(entries)
            if debt is not None:
                debt = debt.detach().to(torch.float32, copy=True).cpu()
                self._carry[name] = self._carry[name] + debt if name in self._carry else debt
        for k in touched:
            self.compressors[k].load_state_dict(states[k])

    def plan_state(self) -> dict[str, Any]:
        """The plan in force (the same on every rank), and this rank's carries and
        measurement waiting for the next plan (per rank)."""
        return {
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "carry": {n: t.clone() for n, t in self._carry.items()},
            "measured": {n: [list(m.shape), m.element_size, list(m.errors)] for n, m in self._measured.items()},
        }

    @staticmethod
    def shared_plan_state(state: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`plan_state` without its per-rank entries (carries, measurement): the plan."""
        return {"plan": state["plan"], "carry": {}, "measured": {}}

    def holds_per_rank(self, state: Mapping[str, Any]) -> bool:
        per_link = self.per_link and state.get("plan") is not None  # one plan per cross group
        return per_link or bool(state.get("carry")) or bool(state.get("measured"))

    def load_plan_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`plan_state` (before the compressors' own states are loaded)."""
        self.plan = LayerPlan.from_dict(state["plan"]) if state["plan"] is not None else None
        self.assigned = dict(self.plan.keys) if self.plan is not None else {}
        self.composite = _Planned(self)
        self._carry = {str(n): t.detach().to(torch.float32, copy=True) for n, t in state["carry"].items()}
        self._measured = {
            str(n): _Measured(tuple(int(d) for d in shape), int(size), [float(e) for e in errors])
            for n, (shape, size, errors) in state["measured"].items()
        }
        self._consumed, self._staged, self._states, self._undo = set(), {}, None, None

    @staticmethod
    def combine_plan_states(shared: Mapping[str, Any], parts: Sequence[Mapping[str, Any]], scale: float) -> dict[str, Any]:
        """One rank's plan state from a job of another world size: old rank 0's plan, the carries
        it takes over summed and scaled as error feedback is, and no waiting measurement."""
        return {"plan": shared["plan"], "carry": sum_entries([p["carry"] for p in parts], scale), "measured": {}}


class _Planned(Composite):
    """A :class:`LayerwiseGroups`' composite: its groups' parts, after :meth:`LayerwiseGroups.prepare`."""

    def __init__(self, groups: LayerwiseGroups) -> None:
        super().__init__(groups.key_for, groups.compressors)
        self.groups = groups

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        self.groups.prepare(bucket, ctx)
        return (yield from super().reduce(bucket, ctx))


def _bytes(compressor: Compressor, slot: ParamSlot, element_size: int) -> float:
    """Bytes per step ``compressor`` sends of ``slot``."""
    transfers = compressor.slot_transfers(slot, element_size)
    if transfers is None:
        raise ConfigError(f"[layerwise]: method {compressor.name!r} does not say what it sends (slot_transfers)")
    return float(sum(t.nbytes for t in transfers))
