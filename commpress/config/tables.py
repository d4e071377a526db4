"""The config tables beside the top-level keys (:data:`TABLE_TYPES`), each a frozen dataclass
validated on construction; the subsystem that applies a table imports it from here."""

from __future__ import annotations

import fnmatch
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from commpress.errors import ConfigError
from commpress.schema import Bounds, check_fields, parse_dataclass

__all__ = [
    "BITS",
    "FULL_PRECISION",
    "OUTER_DEFAULTS",
    "REPLICA_OUTER_LRS",
    "STREAMING_DEFAULTS",
    "TABLES",
    "TABLE_TYPES",
    "BandwidthConfig",
    "DionConfig",
    "FSDPConfig",
    "LayerwiseConfig",
    "LocalSGDConfig",
    "OneBitAdamConfig",
    "Table",
    "check_co2_settings",
    "check_diloco_settings",
    "check_streaming",
    "parse_table",
    "resolve_merge",
]


#: DiLoCo's ``outer_lr`` values that follow the number M of replicas averaging at a sync (which
#: suits which run: docs/local_sgd.md "What sets the best outer lr").
REPLICA_OUTER_LRS: dict[str, Callable[[int], float]] = {
    "sqrt_replicas": math.sqrt,
    "sqrt_twice_replicas": lambda m: math.sqrt(2 * m) if m > 1 else 1.0,
}


@dataclass(frozen=True)
class LocalSGDConfig:
    """The ``[local_sgd]`` table. The outer-step keys apply to ``"co2"`` and ``"diloco"``,
    ``staleness_penalty`` and ``clip`` to ``"co2"``, the keys after them to ``"diloco"``; a key
    left unset takes its algorithm's default (:meth:`value`)."""

    algorithm: Literal["local_sgd", "co2", "diloco"] = "local_sgd"
    period: Annotated[int, Bounds(ge=1)] = 4
    qsr_alpha: Annotated[float, Bounds(gt=0)] | None = None
    qsr_power: Annotated[float, Bounds(gt=0)] = 2.0
    warmup_steps: Annotated[int, Bounds(ge=0)] = 0
    average_buffers: bool = False
    outer_lr: float | Literal[tuple(REPLICA_OUTER_LRS)] | None = None  # type: ignore[valid-type]
    outer_momentum: float | None = None
    nesterov: bool | None = None
    staleness_penalty: float | Literal["adaptive"] | None = None
    clip: float | None = None
    fragments: int | None = None
    sync_delay: int | None = None
    merge: Literal["eager", "mix"] | None = None
    merge_alpha: float | None = None

    def __post_init__(self) -> None:
        check_fields("local_sgd", self)
        for key, algorithms in _KEYS_OF.items():
            if getattr(self, key) is not None and self.algorithm not in algorithms:
                raise ConfigError(
                    f"local_sgd: {key} = {getattr(self, key)!r} does not apply to algorithm = {self.algorithm!r}; "
                    f"it applies to algorithm = {' or '.join(map(repr, algorithms))}"
                )
        try:
            if self.algorithm == "co2":
                outer = (self.value("outer_lr"), self.value("outer_momentum"))
                check_co2_settings(*outer, self.value("staleness_penalty"), self.clip)
            elif self.algorithm == "diloco":
                resolve_merge(self.merge, self.merge_alpha)
                keys = ("outer_lr", "outer_momentum", "nesterov", "fragments", "sync_delay", "merge_alpha")
                check_diloco_settings(*(self.value(k) for k in keys))
                check_streaming(
                    None if self.qsr_alpha is not None else self.period, self.value("fragments"), self.value("sync_delay")
                )
        except ConfigError as exc:
            raise ConfigError(f"local_sgd: {exc}") from None

    def value(self, key: str) -> Any:
        """``key``'s value, or its algorithm's default when unset."""
        if key == "merge":
            return resolve_merge(self.merge, self.merge_alpha)[0]
        value = getattr(self, key)
        if value is not None:
            return value
        return {**OUTER_DEFAULTS.get(self.algorithm, {}), **STREAMING_DEFAULTS}.get(key)


#: The outer step's defaults by algorithm. DiLoCo's suit short periods, unlike the paper's 0.7 /
#: 0.9 tuned for H = 500 (docs/local_sgd.md "Settings measured").
OUTER_DEFAULTS: dict[str, dict[str, Any]] = {
    "co2": {"outer_lr": 1.0, "outer_momentum": 0.0, "staleness_penalty": 1.0},
    "diloco": {"outer_lr": 0.8, "outer_momentum": 0.2, "nesterov": True},
}
#: DiLoCo's streaming keys' defaults: the whole model at once, landing at once.
STREAMING_DEFAULTS: dict[str, Any] = {"fragments": 1, "sync_delay": 0, "merge": None, "merge_alpha": 0.0}
#: How a fragment's average merges into local values that stepped on since its sync started:
#: ``"eager"``, they take the outer step of their own pseudo-gradient at the start and become the
#: new anchor plus the steps since; ``"mix"``, ``merge_alpha * local + (1 - merge_alpha) * anchor``.
MERGES = ("eager", "mix")
#: The algorithms each optional key of ``[local_sgd]`` applies to.
_KEYS_OF: dict[str, tuple[str, ...]] = {
    "outer_lr": ("co2", "diloco"),
    "outer_momentum": ("co2", "diloco"),
    "nesterov": ("diloco",),
    "staleness_penalty": ("co2",),
    "clip": ("co2",),
    **{key: ("diloco",) for key in STREAMING_DEFAULTS},
}


def check_co2_settings(outer_lr: float, outer_momentum: float, staleness_penalty: float | str, clip: float | None) -> None:
    """Raise ConfigError naming the first CO2 setting out of range (or not finite)."""
    _check_outer(outer_lr, outer_momentum)
    if staleness_penalty != "adaptive" and not (_real(staleness_penalty) and staleness_penalty >= 1):
        raise ConfigError(f"staleness_penalty = {staleness_penalty!r} is not accepted; expected a number >= 1 or 'adaptive'")
    if clip is not None and not (_real(clip) and clip > 0):
        raise ConfigError(f"clip = {clip!r} is not accepted; expected a number > 0 or none")


def check_diloco_settings(
    outer_lr: float | str, outer_momentum: float, nesterov: bool, fragments: int, sync_delay: int, merge_alpha: float
) -> None:
    """Raise ConfigError naming the first DiLoCo setting out of range."""
    _check_outer(outer_lr, outer_momentum, scaled=True)
    if nesterov is not True and nesterov is not False:
        raise ConfigError(f"nesterov = {nesterov!r} is not accepted; expected true or false")
    if nesterov and outer_momentum == 0:
        raise ConfigError(
            "nesterov = true is not accepted with outer_momentum = 0; expected outer_momentum > 0 or nesterov = false"
        )
    for key, value, least in (("fragments", fragments, 1), ("sync_delay", sync_delay, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{key} = {value!r} is not accepted; expected an integer >= {least}")
    if not (_real(merge_alpha) and 0 <= merge_alpha < 1):
        raise ConfigError(f"merge_alpha = {merge_alpha!r} is not accepted; expected a number in [0, 1)")


def resolve_merge(merge: str | None, merge_alpha: float | None) -> tuple[str, float]:
    """The ``merge`` and ``merge_alpha`` that given (None: unset) values mean: unset, ``merge`` is
    ``"mix"`` when ``merge_alpha`` is given, else ``"eager"`` (docs/local_sgd.md "Overlap without
    losing steps"); ``merge_alpha`` applies to ``"mix"`` only (unset: 0, the new anchor)."""
    if merge is None:
        merge = "mix" if merge_alpha is not None else "eager"
    if merge not in MERGES:
        raise ConfigError(f"merge = {merge!r} is not accepted; expected one of {', '.join(map(repr, MERGES))}")
    if merge == "eager" and merge_alpha is not None:
        raise ConfigError(
            f"merge_alpha = {merge_alpha!r} is not accepted with merge = 'eager'; expected merge = 'mix' "
            "(merge_alpha is its factor) or no merge_alpha"
        )
    return merge, 0.0 if merge_alpha is None else float(merge_alpha)


def check_streaming(period: int | None, fragments: int, sync_delay: int) -> None:
    """Streaming DiLoCo's schedule: ``fragments`` > 1 or ``sync_delay`` > 0 need a constant
    ``period`` (None: varying) that ``fragments`` divides, and ``sync_delay`` at most ``period /
    fragments``, so a fragment's average lands before the next sync starts."""
    if fragments == 1 and sync_delay == 0:
        return
    if period is None:
        raise ConfigError(f"fragments = {fragments} and sync_delay = {sync_delay} need a constant period; leave qsr_alpha unset")
    if period % fragments:
        raise ConfigError(f"period = {period} is not accepted with fragments = {fragments}; expected a multiple of {fragments}")
    if sync_delay > period // fragments:
        raise ConfigError(
            f"sync_delay = {sync_delay} is not accepted with period = {period} and fragments = {fragments}; expected an "
            f"integer from 0 to {period // fragments} (a fragment's average lands before the next sync starts)"
        )


def _check_outer(outer_lr: float | str, outer_momentum: float, scaled: bool = False) -> None:
    """``scaled``: ``outer_lr`` may also name one of :data:`REPLICA_OUTER_LRS` (DiLoCo's)."""
    if not (_real(outer_lr) and outer_lr > 0) and not (scaled and outer_lr in REPLICA_OUTER_LRS):
        names = ", ".join(map(repr, REPLICA_OUTER_LRS))
        accepted = f"a number > 0 or one of {names}" if scaled else "a number > 0"
        if outer_lr in REPLICA_OUTER_LRS:
            accepted += f" ({names} apply to algorithm = 'diloco')"
        raise ConfigError(f"outer_lr = {outer_lr!r} is not accepted; expected {accepted}")
    if not (_real(outer_momentum) and 0 <= outer_momentum < 1):
        raise ConfigError(f"outer_momentum = {outer_momentum!r} is not accepted; expected a number in [0, 1)")


def _real(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: Bit widths of the stochastic quantizer.
BITS = (2, 4, 8)
#: The ``*_bits`` value that switches quantization off.
FULL_PRECISION = 32


@dataclass(frozen=True)
class FSDPConfig:
    """The ``[fsdp]`` table: quantized FSDP collectives, with QSDP's defaults."""

    weight_bits: int = 8
    grad_bits: int = 8
    bucket_size: int = 1024
    exclude: tuple[str, ...] = ("*norm*", "*embed*", "*.bias")
    min_numel: Annotated[int, Bounds(ge=0)] = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields("fsdp", self, key="fsdp.{key}")  # types, ranges; exclude becomes a tuple
        for key in ("weight_bits", "grad_bits"):
            value = getattr(self, key)
            if value not in (*BITS, FULL_PRECISION):
                raise ConfigError(f"fsdp.{key} = {value!r} is not accepted; accepted: 2, 4, 8 (quantized) or 32 (full precision)")
        if self.bucket_size < 8 or self.bucket_size % 8:
            raise ConfigError(f"fsdp.bucket_size = {self.bucket_size!r} is not accepted; expected a multiple of 8, >= 8")

    def keeps_full_precision(self, name: str, numel: int) -> bool:
        """Whether the parameter called ``name`` with ``numel`` elements is excluded."""
        return numel < self.min_numel or any(fnmatch.fnmatchcase(name, p) for p in self.exclude)


@dataclass(frozen=True)
class BandwidthConfig:
    """The ``[bandwidth]`` table. The plan's unit is a group of ranks running one collective (a
    domain or a cross group). ``budget_ms`` > 0: each cross group gets the least compression whose
    predicted step transfer fits it; 0: every group's predicted time is at most ``1 + slowdown``
    times the fastest's; the wire-bytes ratio stays within [``min_ratio``, ``max_ratio``]."""

    adaptive: bool = False
    budget_ms: Annotated[float, Bounds(ge=0)] = 0.0
    slowdown: Annotated[float, Bounds(ge=0)] = 0.0
    min_ratio: Annotated[float, Bounds(gt=0, le=1)] = 0.01
    max_ratio: float = 1.0
    #: re-measure the links and re-plan every this many steps (0: only at start-up)
    remeasure_every: Annotated[int, Bounds(ge=0)] = 0
    #: links at least this fast join ranks into one domain; 0 = automatic (largest gap)
    fast_gbps: Annotated[float, Bounds(ge=0)] = 0.0
    #: domains join ranks on one host (and network namespace), linked by fast links, or either ("auto")
    group_by: Literal["auto", "bandwidth", "host"] = "auto"
    #: declared domains (lists of ranks), used instead of the measured grouping
    domains: tuple[tuple[int, ...], ...] = ()
    #: how long one bandwidth probe should last (larger: more accurate, slower start-up)
    probe_ms: Annotated[float, Bounds(gt=0, le=10_000)] = 40.0

    def __post_init__(self) -> None:
        check_fields("[bandwidth]", self, key="[bandwidth] {key}")
        _check("max_ratio", self.max_ratio, self.min_ratio <= self.max_ratio <= 1, f"a number in [min_ratio={self.min_ratio}, 1]")
        ranks = [r for d in self.domains for r in d]
        if self.domains and (sorted(ranks) != list(range(len(ranks))) or not all(self.domains)):
            raise ConfigError(
                f"[bandwidth] domains = {[list(d) for d in self.domains]!r} is not accepted; expected non-empty "
                "lists of ranks that together hold every rank 0..n-1 exactly once"
            )


def _check(key: str, value: Any, ok: bool, accepted: str, table: str = "bandwidth") -> None:
    if not ok:
        raise ConfigError(f"[{table}] {key} = {value!r} is not accepted; expected {accepted}")


@dataclass(frozen=True)
class LayerwiseConfig:
    """The ``[layerwise]`` table: each tensor of the main method gets its own setting (the method's
    knob, another method, or exact / fp16), chosen every ``every`` steps (docs/choosing.md) to
    minimise the compression error on the run's gradients within ``budget``: ``"uniform"`` (the
    configured setting's bytes), bytes per step and rank, or a fraction of the float32 bytes."""

    enabled: bool = False
    budget: Literal["uniform"] | int | float = "uniform"
    every: Annotated[int, Bounds(ge=1, note="steps between plans")] = 200

    def __post_init__(self) -> None:
        check_fields("[layerwise]", self, key="[layerwise] {key}")
        budget = self.budget
        if budget != "uniform":
            _check("budget", budget, budget >= 1 if isinstance(budget, int) else 0 < budget < 1, BUDGET_ACCEPTED, "layerwise")


#: What ``[layerwise] budget`` accepts, for error messages.
BUDGET_ACCEPTED = "'uniform', an integer >= 1 (bytes per step and rank) or a number in (0, 1) (a ratio of float32 bytes)"


@dataclass(frozen=True)
class OneBitAdamConfig:
    """The ``[onebit_adam]`` table: 1-bit Adam on the user's AdamW, the momentum averaged through
    the top-level ``method`` after ``warmup`` exact AdamW steps (a count, or a fraction of
    ``register(..., total_steps=N)``; the default is the 1-bit Adam paper's share for BERT-Large)."""

    warmup: int | float = 0.15

    def __post_init__(self) -> None:
        check_fields("[onebit_adam]", self)
        ok = self.warmup >= 1 if isinstance(self.warmup, int) else 0 < self.warmup < 1
        _check("warmup", self.warmup, ok, WARMUP_ACCEPTED, "onebit_adam")

    def warmup_steps(self, total_steps: int | None) -> int:
        """The warm-up in steps; a fraction needs ``total_steps``."""
        if isinstance(self.warmup, int):
            return self.warmup
        if total_steps is None:
            raise ConfigError(
                f"[onebit_adam] warmup = {self.warmup} is a fraction of the run: pass register(..., total_steps=N), "
                "or give warmup as a number of steps (an integer >= 1)"
            )
        return max(1, round(self.warmup * total_steps))


#: What ``[onebit_adam] warmup`` accepts, for error messages.
WARMUP_ACCEPTED = "an integer >= 1 (exact AdamW steps) or a number in (0, 1) (a fraction of total_steps)"


@dataclass(frozen=True)
class DionConfig:
    """The ``[dion]`` table: Dion's low-rank orthonormal updates in place of Muon's step, the ranks
    exchanging only the factors; Muon's lr, weight decay, lr adjustment and momentum carry over."""

    rank: Annotated[int, Bounds(ge=1)] | Annotated[float, Bounds(gt=0, lt=1, note="of each matrix's smaller side")] = 16
    seed: Annotated[int, Bounds(ge=0)] = 0

    def __post_init__(self) -> None:
        check_fields("[dion]", self)


#: Any one table's settings, as :meth:`commpress.Config.section` returns it.
Table = LocalSGDConfig | FSDPConfig | BandwidthConfig | LayerwiseConfig | OneBitAdamConfig | DionConfig

#: Every table a config may hold: its name -> its dataclass.
TABLE_TYPES: dict[str, type[Table]] = {
    "local_sgd": LocalSGDConfig,
    "fsdp": FSDPConfig,
    "bandwidth": BandwidthConfig,
    "layerwise": LayerwiseConfig,
    "onebit_adam": OneBitAdamConfig,
    "dion": DionConfig,
}

#: How errors name each table's keys (``[dion] rank = 0 ...``; ``local_sgd: period = 0 ...``).
_LABELS = {**{name: f"[{name}]" for name in TABLE_TYPES}, "local_sgd": "local_sgd", "fsdp": "fsdp"}


def parse_table(name: str, data: Mapping[str, Any], belongs: Callable[[str], str] | None = None) -> Table:
    """The ``[name]`` table's dataclass from ``data`` (``belongs``: as for :func:`~commpress.schema.check_kwargs`)."""
    return parse_dataclass(_LABELS[name], TABLE_TYPES[name], data, belongs)


#: Every table a config may hold: its name -> its parser.
TABLES: dict[str, Callable[[Mapping[str, Any]], Table]] = {name: functools.partial(parse_table, name) for name in TABLE_TYPES}
