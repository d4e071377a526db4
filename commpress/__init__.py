"""commpress: communication compression for data-parallel PyTorch training.

Quick start::

    state = commpress.register(ddp_model, "docs/configs/powersgd.toml", optimizer=optimizer)

Names and subpackages load at first use, so ``import commpress`` and ``commpress --help`` do
not load torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from commpress.errors import ConfigError

if TYPE_CHECKING:
    from commpress.comm.checkpoint import DCPState
    from commpress.config import Config
    from commpress.hooks import CommState, ddp_hook
    from commpress.registration import Registration, register

__all__ = ["CommState", "Config", "ConfigError", "DCPState", "Registration", "ddp_hook", "register"]
__version__ = "0.1.0"

#: Name -> the module that defines it.
_LAZY = {
    "CommState": "commpress.hooks",
    "Config": "commpress.config",
    "DCPState": "commpress.comm.checkpoint",
    "Registration": "commpress.registration",
    "ddp_hook": "commpress.hooks",
    "register": "commpress.registration",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
