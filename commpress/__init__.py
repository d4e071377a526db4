"""commpress: communication compression for data-parallel PyTorch training.

Quick start::

    state = commpress.register(ddp_model, "docs/configs/powersgd.toml", optimizer=optimizer)
"""

from commpress.comm.checkpoint import DCPState
from commpress.config import Config
from commpress.errors import ConfigError
from commpress.hooks import CommState, ddp_hook
from commpress.registration import Registration, register

__all__ = ["CommState", "Config", "ConfigError", "DCPState", "Registration", "ddp_hook", "register"]
__version__ = "0.1.0"
