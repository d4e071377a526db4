"""Which parts of a config apply to which kind of model, and which combine: the one place
:func:`commpress.register` and every lower-level entry point ask, so that no table is dropped
without a word. A config's *items* (:data:`ITEMS`) are its tables and the top-level settings only
some parts take; a *part* (:data:`PARTS`) is one adapter, chosen by its own table (the hooks by
none), that applies to some model kinds (:data:`KINDS`) and takes some items along. Anything else
is refused with a :class:`~commpress.errors.ConfigError` naming the items, the model kind and
what to do instead. The docs' tables are rendered from here (:func:`rst_table`)."""

from __future__ import annotations

import itertools
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from commpress.config import Config
from commpress.config.tables import TABLE_TYPES
from commpress.errors import ConfigError

__all__ = [
    "APART",
    "ITEMS",
    "KINDS",
    "NEEDS",
    "NOT_MANAGED",
    "NOT_ON",
    "PARTS",
    "Part",
    "check_part",
    "items_of",
    "label",
    "markdown_table",
    "model_kind",
    "part_for",
    "refused_items",
    "rst_table",
]

#: Model kinds, and how refusals name them.
KINDS: dict[str, str] = {
    "DDP": "a DistributedDataParallel model",
    "FSDP2": "a model sharded with fully_shard (FSDP2)",
    "groups": "a model sharded with fully_shard inside replica groups (register(..., mesh=) with a 2-D mesh)",
    "FSDP1": "an FSDP1 root (FullyShardedDataParallel)",
    "plain": "a plain module (neither DistributedDataParallel nor sharded) in a job of several processes",
    "single": "a single process (torch.distributed not initialized)",
}
#: How refusals name a run under a torchft Manager.
MANAGED = "under a torchft Manager"
#: What to hand register() instead, by kind: the words after "hand register() ".
_KIND_ADVICE = {
    "DDP": "the model wrapped in DistributedDataParallel",
    "FSDP2": "the model sharded with fully_shard",
    "groups": "the model sharded over mesh['shard'] with mesh=mesh",
    "FSDP1": "the FSDP1 root",
    "plain": "the plain module",
}
#: What to hand register() instead under a torchft Manager, where it differs.
_MANAGED_ADVICE = {
    "DDP": "the module wrapped by commpress.hooks.managed_ddp",
    "FSDP2": "the model sharded with fully_shard over its replica group's ranks",
}

#: What adding a part's table does by default, where that needs saying.
_ADD_HINT = {
    "fsdp": " ([fsdp] with no keys takes QSDP's defaults, 8-bit weights and gradients; weight_bits = grad_bits = 32 "
    "leaves FSDP as it is)"
}

#: The top-level settings that only some parts take, then every table.
ITEMS: tuple[str, ...] = ("method", "overrides", "start_iter", "backend", *TABLE_TYPES)


def label(item: str) -> str:
    """How refusals and the docs name an item: ``[local_sgd]``, ``method``, ``backend = 'mpi'``."""
    if item in TABLE_TYPES:
        return f"[{item}]"
    return "backend = 'mpi'" if item == "backend" else item


def items_of(config: Config) -> tuple[str, ...]:
    """The items ``config`` sets (a default value sets none), in :data:`ITEMS` order."""
    found = {
        "method": config.method != "none",
        "overrides": bool(config.overrides),
        "start_iter": config.start_iter > 0,
        "backend": config.backend != "torch",
        **{name: config.section(name) is not None for name in TABLE_TYPES},
    }
    return tuple(item for item in ITEMS if found[item])


@dataclass(frozen=True)
class Part:
    """One adapter a config reaches: ``name`` is its state_dict key, ``table`` chooses it (None: a
    hook), ``kinds`` (``managed``: under a torchft Manager) the models it applies to, ``takes``
    the items it applies along; ``does`` and ``entry`` tell refusals what it does and how to apply it."""

    name: str
    table: str | None
    kinds: tuple[str, ...]
    takes: frozenset[str]
    does: str
    entry: str
    named: str = ""  # how a part chosen by no table is named
    managed: tuple[str, ...] = ()

    @property
    def title(self) -> str:
        return self.named or label(self.table or "")

    def kinds_for(self, managed: bool) -> tuple[str, ...]:
        """The kinds it applies to, under a torchft Manager (``managed``) or not."""
        return self.managed if managed else self.kinds


#: Every part, the DDP hook first (the one a DDP model gets when no other table chooses).
PARTS: dict[str, Part] = {
    p.name: p
    for p in (
        Part(
            "ddp_hook",
            None,
            ("DDP",),
            frozenset({"method", "overrides", "start_iter", "backend", "bandwidth", "layerwise"}),
            "the DDP comm hook compresses the gradient buckets",
            "commpress.register(ddp_model, config) (the DDP hook)",
            "the DDP hook",
            ("DDP",),
        ),
        Part(
            "groups_hook",
            None,
            ("groups",),
            frozenset({"method"}),
            "the cross-group hook averages each gradient shard over the replica groups, compressed elementwise",
            "commpress.register(model, config, mesh=mesh) (the cross-group gradient hook)",
            "the cross-group hook",
        ),
        Part(
            "local_sgd",
            "local_sgd",
            ("DDP", "plain", "groups"),
            frozenset({"method", "backend"}),
            "Local SGD / CO2 / DiLoCo keep gradients local and average the whole model (with mesh=, each rank's "
            "shard over the replica groups) as one vector with the top-level method, at the optimizer's step",
            "commpress.register(model, config, optimizer=optimizer) (Local SGD / CO2 / DiLoCo at the optimizer's step)",
            managed=("DDP", "plain", "FSDP2"),
        ),
        Part(
            "onebit_adam",
            "onebit_adam",
            ("DDP",),
            frozenset({"method", "backend"}),
            "1-bit Adam takes over AdamW's step: exact gradients for the warm-up, then local gradients and the "
            "momentum averaged as one vector with the top-level method",
            "commpress.register(ddp_model, config, optimizer=adamw) (1-bit Adam at the optimizer's step)",
            managed=("DDP",),
        ),
        Part(
            "dion",
            "dion",
            ("DDP",),
            frozenset({"method"}),
            "Dion takes over Muon's step: Muon's gradients stay local and its matrices step by low-rank orthonormal "
            "updates from factors the ranks average; the other gradients are averaged with the top-level method",
            "commpress.register(ddp_model, config, optimizer=[muon, adamw]) (Dion at Muon's step)",
            managed=("DDP",),
        ),
        Part(
            "fsdp",
            "fsdp",
            ("FSDP2", "FSDP1"),
            frozenset(),
            "[fsdp] sets a sharded model's own collectives (weight_bits, grad_bits) on its torch.distributed mesh",
            "commpress.register(model, config) on a model sharded with fully_shard or an FSDP1 root",
        ),
    )
}

#: An item a part takes only with another: item -> (the item it needs, why).
NEEDS: dict[str, tuple[str, str]] = {
    "layerwise": ("method", "it plans the top-level method's setting per tensor, and method = 'none' has none to plan"),
}
#: Items a part takes, but not on a kind of model: kind -> item -> why.
NOT_ON: dict[str, dict[str, str]] = {
    "groups": {"backend": "the replica groups of mesh['replicate'] communicate through torch.distributed"},
}
#: Items a part takes, but not under a torchft Manager: item -> why.
NOT_MANAGED: dict[str, str] = {
    "bandwidth": "the bandwidth layer measures the links between fixed ranks",
    "backend": "every collective goes through the manager",
}
#: Items a part takes, but not together: the pair -> why.
APART: dict[frozenset[str], str] = {
    frozenset({"bandwidth", "backend"}): "[bandwidth] measures the links and reduces through torch.distributed",
}


def model_kind(model: torch.nn.Module, backend: str = "torch", mesh: Any = None, managed: bool = False) -> str:
    """``model``'s key in :data:`KINDS`; ``"single"`` when there is nobody to send to (no
    torch.distributed, the torch backend, no manager)."""
    if mesh is not None:
        return "groups"
    if isinstance(model, FullyShardedDataParallel):
        return "FSDP1"
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "FSDP2"
    if isinstance(model, DistributedDataParallel):
        return "DDP"
    return "plain" if dist.is_initialized() or backend != "torch" or managed else "single"


def _names(items: Any) -> str:
    named = [label(i) for i in items]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"


def _where(item: str) -> str:
    """Which parts apply ``item``, and on which models."""
    takers = [p for p in PARTS.values() if item in p.takes or item == p.table]
    return " or ".join(f"{p.title} (on {', '.join(p.kinds)})" for p in takers)


def _apply_with(item: str) -> str:
    """Where to apply ``item`` instead: its part's entry point, or the parts that take it."""
    chosen = [p for p in PARTS.values() if p.table == item]
    return f"apply {label(item)} with {chosen[0].entry}" if chosen else f"{label(item)} applies with {_where(item)}"


def _advice(kind: str, managed: bool) -> str:
    """What to hand register() to make a model of ``kind`` (under a torchft Manager: ``managed``)."""
    return (_MANAGED_ADVICE.get(kind) if managed else None) or _KIND_ADVICE[kind]


def _verdict(items: tuple[str, ...], kind: str, managed: bool = False) -> tuple[Part | None, tuple[str, ...], str]:
    """The part that applies ``items`` on ``kind`` (None in a single process), or the items refused
    and why, with what to do instead (``why`` empty: accepted)."""
    chosen = [p for p in PARTS.values() if p.table in items]
    if len(chosen) > 1:
        tables = tuple(i for i in ITEMS if any(i == p.table for p in chosen))
        why = "; ".join(f"{label(p.table)}: {p.does}" for p in chosen)
        return None, tables, f"each runs the training step its own way ({why}): keep one of them"
    if kind == "single":  # nothing applies; refuse a config that applies to no model
        _, refused, why = _verdict(items, chosen[0].kinds[0] if chosen else "DDP")
        return None, refused, (why and f"it applies to no model: {why}")
    part = chosen[0] if chosen else next((p for p in PARTS.values() if p.table is None and kind in p.kinds_for(managed)), None)
    if part is None:
        tables = [p.table for p in PARTS.values() if p.table is not None and kind in p.kinds_for(managed)]
        kinds_of = [p.kinds_for(managed) for p in PARTS.values()]
        others = dict.fromkeys(_advice(k[0], managed) for k in kinds_of if k and kind not in k)
        instead = f"hand register() {' or '.join(others)}"
        if not tables:
            return None, items, f"nothing applies to this model {MANAGED}: {instead}"
        add = " or ".join(f"add {label(t)}{_ADD_HINT.get(t, '')}" for t in tables)
        return None, items, f"this model takes only {_names(tables)}: {add}, or {instead}"
    kinds = part.kinds_for(managed)
    if kind not in kinds:
        if not kinds:
            return None, (part.table,), f"{part.does}; it does not run {MANAGED}: remove it"
        instead = " or ".join(_advice(k, managed) for k in kinds)
        where = f" {MANAGED}" if managed else ""
        why = f"{part.does}; it applies{where} to {' and '.join(kinds)} models: remove it, or hand register() {instead}"
        return None, (part.table,), why
    extra = tuple(i for i in items if i != part.table and i not in part.takes)
    if extra:
        where = "; ".join(f"{label(i)} applies with {_where(i)}" for i in extra)
        them = "it" if len(extra) == 1 else "them"
        return None, extra, f"{part.title} does not take {them} ({part.does}): remove {them} ({where})"
    for reasons, where in ((NOT_ON.get(kind, {}), "on these models"), (NOT_MANAGED if managed else {}, MANAGED)):
        banned = tuple(i for i in items if i in reasons)
        if banned:
            why = "; ".join(reasons[i] for i in banned)
            return None, banned, f"{part.title} does not take {_names(banned)} {where} ({why}): remove it"
    for item, (need, why) in NEEDS.items():
        if item in items and need not in items:
            return None, (item,), f"{label(item)} needs a top-level {label(need)}: {why}"
    for pair, why in APART.items():
        if pair <= set(items):
            return None, tuple(i for i in ITEMS if i in pair), f"they do not combine: {why}: remove one"
    return part, (), ""


def refused_items(config: Config, kind: str, managed: bool = False) -> tuple[str, ...] | None:
    """The items :func:`part_for` refuses in ``config`` on ``kind``, or None when it applies."""
    _, refused, why = _verdict(items_of(config), kind, managed)
    return refused if why else None


def part_for(config: Config, kind: str, entry: str = "commpress.register()", managed: bool = False) -> Part | None:
    """The part that applies ``config`` to a model of ``kind`` (None in a single process); raises
    :class:`ConfigError` naming the items refused, the kind and what to do instead."""
    return _decide(items_of(config), kind, entry, managed)


def _decide(items: tuple[str, ...], kind: str, entry: str, managed: bool = False) -> Part | None:
    part, refused, why = _verdict(items, kind, managed)
    if why:
        what = f"the config's {_names(refused)} cannot apply" if refused else "the config cannot apply"
        where = f" {MANAGED}" if managed else ""
        raise ConfigError(f"{entry}{where} on {KINDS[kind]}: {what}: {why}")
    return part


def check_part(config: Config, name: str, entry: str, kind: str | None = None, managed: bool = False) -> None:
    """Refuse what the lower-level ``entry``, which applies part ``name`` alone, does not: another
    part's items (saying where they apply), and what :func:`part_for` refuses on ``kind``
    (default: its first kind) once the part's table is added."""
    part = PARTS[name]
    items = items_of(config)
    foreign = [i for i in items if i != part.table and i not in part.takes]
    if foreign:
        where = "; ".join(_apply_with(i) for i in foreign)
        what = f"the config's {_names(foreign)} cannot apply"
        raise ConfigError(f"{entry} applies {part.title} only ({part.does}); {what}: {where}")
    if kind != "single":
        _decide(tuple(i for i in ITEMS if i in items or i == part.table), kind or part.kinds_for(managed)[0], entry, managed)


def _applies(kind: str, managed: bool = False) -> list[str]:
    """What applies on ``kind``, one phrase per part."""
    default = any(p.table is None and kind in p.kinds_for(managed) for p in PARTS.values())
    left_out = {**NOT_ON.get(kind, {}), **(NOT_MANAGED if managed else {})}
    out = []
    for p in PARTS.values():
        if kind in p.kinds_for(managed):
            head = p.title if p.table is None else f"{label(p.table)} {'instead' if default else '(required)'}"
            takes = ", ".join(label(i) for i in ITEMS if i in p.takes and i not in left_out)
            out.append(f"{head}, with {takes}" if takes else f"{head} alone")
    return out


def _rows() -> list[tuple[str, list[str]]]:
    """The rows of the docs' tables: (the model, what applies), then the same under a manager."""
    rules = [f"{label(i)} needs {label(n)}" for i, (n, _) in NEEDS.items()]
    rules += [f"{_names(i for i in ITEMS if i in pair)} do not combine" for pair in APART]
    rows = [(_model_name(k), _applies(k)) for k in KINDS if k != "single"]
    rows[0][1].append("; ".join(rules))
    rows += [(f"{_model_name(k)}, {MANAGED}", _applies(k, True)) for k in KINDS if k != "single" and _applies(k, True)]
    rows.append((_model_name("single"), ["nothing; a config that applies to no model is refused"]))
    return rows


def _model_name(kind: str) -> str:
    return KINDS[kind].removeprefix("a ").removeprefix("an ")


def markdown_table() -> str:
    """The table of what applies where, as README.md holds it."""
    lines = ["| model | what applies |", "|---|---|"]
    lines += [f"| {model} | {'; '.join(parts)} |" for model, parts in _rows()]
    return "\n".join(lines)


def rst_table(width: int = 44) -> str:
    """The same table as :mod:`commpress.registration`'s docstring holds it."""
    rule = f"{'=' * width}  {'=' * width}"
    lines = [rule, f"{'model':<{width}}  what applies", rule]
    for model, parts in _rows():
        left = textwrap.wrap(model, width)
        right = textwrap.wrap("; ".join(parts), width)
        for a, b in itertools.zip_longest(left, right, fillvalue=""):
            lines.append(f"{a:<{width}}  {b}".rstrip())
    lines.append(rule)
    return "\n".join(lines)
