"""What the DDP hooks refuse in a model at registration."""

from __future__ import annotations

import torch

from commpress.compressors import compressor_class
from commpress.compressors.registry import methods_taking
from commpress.config import Config
from commpress.config.groups import MethodGroups
from commpress.errors import ConfigError

__all__ = ["check_model"]


def check_model(model: torch.nn.Module, config: Config, groups: MethodGroups) -> None:
    """Refuse, at registration, what the hooks cannot reduce: sparse gradients, parameter
    dtypes a group's method does not take, override globs that match no parameter."""
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) is True:
            raise ConfigError(
                f"module {name or type(module).__name__!r} ({type(module).__name__}) has sparse=True: DDP comm hooks "
                "reduce dense gradient buckets only; construct it with sparse=False to use commpress"
            )
    names = []
    refused: dict[tuple[str, torch.dtype], list[str]] = {}  # (method, dtype) -> parameter names
    for name, p in model.named_parameters():
        names.append(name)
        compressor = groups.compressors[groups.key_for(name)]
        if p.requires_grad and p.dtype not in compressor.dtypes:
            refused.setdefault((compressor.name, p.dtype), []).append(name)
    if refused:
        raise ConfigError("; ".join(_dtype_advice(method, dtype, found, config) for (method, dtype), found in refused.items()))
    unmatched = config.unmatched_overrides(names)
    if unmatched:
        raise ConfigError(f"overrides: params {unmatched} match no parameter of the model (names look like {names[:3]})")


def _dtype_advice(method: str, dtype: torch.dtype, names: list[str], config: Config) -> str:
    """Which parameters of ``dtype`` ``method`` refuses, and a fix: an override to a method that
    takes the dtype, or converting them."""
    shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    dtype_name = str(dtype).removeprefix("torch.")
    accepted = ", ".join(str(d).removeprefix("torch.") for d in compressor_class(method).dtypes)
    found = f"{len(names)} parameter{'s' if len(names) > 1 else ''} of dtype {dtype_name} ({shown})"
    takers = methods_taking(dtype)
    if not takers:
        return f"{found}: no method takes {dtype_name} (method {method!r} takes {accepted}): convert them to one of those"
    globs = ", ".join(f'"{n}"' for n in names[:4])
    if len(names) > 4:
        globs += f", ... (all {len(names)}, or globs that match them)"
    first = " as the first [[overrides]] entry (the first match wins)" if config.overrides else ""
    return (
        f"{found}: method {method!r} does not take {dtype_name} (accepted: {accepted}); convert them, or send "
        f'them with {" / ".join(takers)} through an override{first}: [[overrides]] params = [{globs}], method = "{takers[0]}"'
    )
