"""commpress: communication compression for data-parallel PyTorch training.

Quick start::

    state = commpress.register(ddp_model, {"method": "powersgd", "params": {"rank": 4}})
"""

from commpress.comm.checkpoint import DCPState
from commpress.config import Config
from commpress.errors import ConfigError
from commpress.hooks import CommState, ddp_hook, register

__all__ = ["CommState", "Config", "ConfigError", "DCPState", "ddp_hook", "register"]
__version__ = "0.1.0"
