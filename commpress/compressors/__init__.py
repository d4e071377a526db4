"""Pure compression algorithms, each a generator over collectives (see ``base``).

Every module of this package is imported here, so a compressor registers itself
(``@register_compressor``) by being a file of the package: adding one touches that file only.
The rest of the library names no method but :data:`EXACT`, the exact average it falls back to.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from commpress.compressors.base import (
    AllGather,
    AllReduce,
    Bucket,
    Collective,
    Compressor,
    Context,
    ParamSlot,
    Reduction,
    Setting,
    Transfer,
    lay_out,
    without_per_rank,
)
from commpress.compressors.registry import EXACT, available, build, check_params, compressor_class, register_compressor

for _module in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
    _importlib.import_module(f"{__name__}.{_module}")

__all__ = [
    "EXACT",
    "AllGather",
    "AllReduce",
    "Bucket",
    "Collective",
    "Compressor",
    "Context",
    "ParamSlot",
    "Reduction",
    "Setting",
    "Transfer",
    "available",
    "build",
    "check_params",
    "compressor_class",
    "lay_out",
    "register_compressor",
    "without_per_rank",
]
