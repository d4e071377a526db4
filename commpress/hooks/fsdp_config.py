"""The ``[fsdp]`` config table: what the FSDP hooks quantize, and how.

::

    [fsdp]
    weight_bits = 8            # parameter all-gather (QSDP); 32 = full precision
    grad_bits = 8              # gradient reduce-scatter; 32 = full precision
    bucket_size = 1024         # elements sharing one (min, scale) pair
    exclude = ["*norm*", "*embed*", "*.bias"]   # parameter-name globs kept in full precision
    min_numel = 4096           # parameters with fewer elements stay full precision
    seed = 0                   # stochastic rounding seed (ranks and steps derive their own)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from commpress.config import register_section
from commpress.errors import ConfigError
from commpress.schema import parse_dataclass

__all__ = ["BITS", "FULL_PRECISION", "FSDPConfig"]

#: Bit widths of the stochastic quantizer.
BITS = (2, 4, 8)
#: The ``*_bits`` value that switches quantization off.
FULL_PRECISION = 32
#: Keys that mark a dict as a whole commpress config rather than the ``[fsdp]`` table.
_CONFIG_KEYS = {"fsdp", "method", "params", "start_iter", "backend", "overrides"}


@dataclass(frozen=True)
class FSDPConfig:
    """Settings of the FSDP hooks (the ``[fsdp]`` table). Defaults follow QSDP: 8-bit
    weights and gradients, buckets of 1024 elements, norms/embeddings/biases and small
    tensors in full precision."""

    weight_bits: int = 8
    grad_bits: int = 8
    bucket_size: int = 1024
    exclude: tuple[str, ...] = ("*norm*", "*embed*", "*.bias")
    min_numel: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("weight_bits", "grad_bits"):
            value = getattr(self, key)
            if value not in (*BITS, FULL_PRECISION) or isinstance(value, bool):
                raise ConfigError(f"fsdp.{key} = {value!r} is not accepted; accepted: 2, 4, 8 (quantized) or 32 (full precision)")
        if not isinstance(self.bucket_size, int) or self.bucket_size < 8 or self.bucket_size % 8:
            raise ConfigError(f"fsdp.bucket_size = {self.bucket_size!r} is not accepted; expected a multiple of 8, >= 8")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ConfigError(f"fsdp.min_numel = {self.min_numel!r} is not accepted; expected an integer >= 0")
        if isinstance(self.exclude, str) or not all(isinstance(p, str) for p in self.exclude):
            raise ConfigError(f"fsdp.exclude = {self.exclude!r} is not accepted; expected a list of parameter-name globs")
        object.__setattr__(self, "exclude", tuple(self.exclude))

    def keeps_full_precision(self, name: str, numel: int) -> bool:
        """Whether the parameter called ``name`` with ``numel`` elements is excluded."""
        return numel < self.min_numel or any(fnmatch.fnmatchcase(name, p) for p in self.exclude)

    @classmethod
    def load(cls, source: Any = None) -> FSDPConfig:
        """An FSDPConfig from itself, a :class:`commpress.Config` (its ``[fsdp]`` table), a
        dict holding an ``fsdp`` table or the table's keys, or the path of a TOML file."""
        from commpress.config import Config

        if source is None:
            return cls()
        if isinstance(source, cls):
            return source
        if isinstance(source, Mapping) and not set(source) & _CONFIG_KEYS:
            return parse(source)  # the table's keys alone
        section = Config.load(source).section("fsdp")
        return section if section is not None else cls()


def parse(data: Mapping[str, Any]) -> FSDPConfig:
    """Validate an ``[fsdp]`` table (ConfigError names key, value and accepted values)."""
    return parse_dataclass("fsdp", FSDPConfig, data)


register_section("fsdp", parse)
