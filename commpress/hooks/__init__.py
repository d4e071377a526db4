"""Adapters that turn a compressor plus a backend into framework hooks."""

from commpress.hooks.ddp import ddp_hook, register_ddp_hook
from commpress.hooks.managed_ddp import managed_ddp
from commpress.hooks.state import CommState

__all__ = ["CommState", "ddp_hook", "managed_ddp", "register_ddp_hook"]
