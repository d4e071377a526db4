"""What ``commpress bench`` compares: PyTorch baselines and commpress configs.

Method lists follow the grammar every command shares (:mod:`commpress.cmdline`):
``name[:key=value,...]``, separated by ``;`` or ``,`` (``none,fp16,powersgd:rank=4,start_iter=2``
is three methods). Baselines run in the same process, on the same model and data:

- ``ddp``: DDP's own all-reduce, no hook (the reference for speed-ups);
- ``torch-fp16``: PyTorch's ``fp16_compress_hook``;
- ``torch-powersgd[:rank=4,start_iter=2,min_compression_rate=2]``: PyTorch's
  ``powerSGD_hook``. It fails on gloo with more than one DDP bucket, so it always runs with
  a single bucket (``bucket_cap_mb`` above the model size); its row says so.

Any other name is a commpress method (``commpress.compressors.available()``), run through
:func:`commpress.register` with DDP's default buckets. A config file (``--config``) is one
more row; one with ``[layerwise] enabled = true`` plans each tensor's setting as in
training, and its row reports what the planning cost (:mod:`commpress.bench.report`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commpress.bench.arguments import split_method_list
from commpress.cmdline import parse_method_spec
from commpress.compressors import available
from commpress.config import Config
from commpress.errors import ConfigError
from commpress.schema import check_kwargs, signature_fields

__all__ = ["BASELINES", "BenchMethod", "default_methods", "method_from_config", "parse_methods"]


def _ddp() -> dict[str, Any]:
    return {}


def _torch_fp16() -> dict[str, Any]:
    return {}


def _torch_powersgd(rank: int = 4, start_iter: int = 2, min_compression_rate: float = 2.0) -> dict[str, Any]:
    if rank < 1:
        raise ConfigError(f"torch-powersgd: rank = {rank} is not accepted; expected an integer >= 1")
    if start_iter < 2:
        raise ConfigError(f"torch-powersgd: start_iter = {start_iter} is not accepted; PyTorch needs >= 2 with error feedback")
    return {"rank": rank, "start_iter": start_iter, "min_compression_rate": min_compression_rate}


#: Baseline name -> function validating its parameters (typed keywords) into a dict.
BASELINES = {"ddp": _ddp, "torch-fp16": _torch_fp16, "torch-powersgd": _torch_powersgd}


@dataclass(frozen=True)
class BenchMethod:
    """One row: a baseline (``kind`` is its name) or a commpress ``config`` (kind "commpress")."""

    label: str
    kind: str
    config: Config | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def note(self) -> str:
        """What the table says beside the label: PyTorch's PowerSGD runs in one bucket, a
        ``[layerwise]`` config plans per tensor."""
        if self.kind == "torch-powersgd":
            return "1 bucket"
        layerwise = self.config.section("layerwise") if self.config is not None else None
        return f"layer-wise, planned every {layerwise.every} steps" if layerwise is not None and layerwise.enabled else ""


def parse_methods(methods: str | Sequence[str]) -> list[BenchMethod]:
    """A method list (``"ddp;torch-powersgd:rank=4;powersgd:rank=4"``) or its specs ->
    validated rows."""
    text = methods if isinstance(methods, str) else ";".join(methods)
    try:
        specs = split_method_list(text)
    except ConfigError as exc:
        raise ConfigError(f"--methods {text!r}: {exc}") from None
    if not specs:
        raise ConfigError(f"--methods {text!r} names no method")
    rows = []
    for spec in specs:
        try:
            rows.append(_parse_one(spec))
        except ConfigError as exc:
            raise ConfigError(f"--methods {spec!r}: {exc}") from None
    return rows


def _parse_one(spec: str) -> BenchMethod:
    name = spec.partition(":")[0].strip()
    if name in BASELINES:
        raw = parse_method_spec(spec)
        params = {**raw["params"], **{k: raw[k] for k in ("start_iter", "backend") if k in raw}}
        checked = check_kwargs(f"baseline {name!r}", params, signature_fields(BASELINES[name]))
        return BenchMethod(spec, name, params=BASELINES[name](**checked))
    if name not in available():
        accepted = ", ".join([*BASELINES, *available()])
        raise ConfigError(f"{name!r} is neither a baseline nor a commpress method; accepted: {accepted}")
    return BenchMethod(spec, "commpress", config=Config.from_dict(parse_method_spec(spec)))


def method_from_config(path: str) -> BenchMethod:
    """A row for the commpress config file ``path`` (labelled with the file name)."""
    return BenchMethod(Path(path).stem, "commpress", config=Config.load(path))


def default_methods() -> list[BenchMethod]:
    """The baselines, then every registered commpress method with its default parameters."""
    return parse_methods(["ddp", "torch-fp16", "torch-powersgd:rank=4", *available()])
