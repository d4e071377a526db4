"""Pure compression algorithms, each a generator over collectives (see ``base``)."""

from commpress.compressors import acpsgd as _acpsgd  # noqa: F401  (registers ACP-SGD)
from commpress.compressors import allreduce as _allreduce  # noqa: F401  (registers built-ins)
from commpress.compressors import powersgd as _powersgd  # noqa: F401  (registers PowerSGD)
from commpress.compressors import terngrad as _terngrad  # noqa: F401
from commpress.compressors import topk as _topk  # noqa: F401
from commpress.compressors.base import (
    AllGather,
    AllReduce,
    Bucket,
    Collective,
    Compressor,
    Context,
    ParamSlot,
    Reduction,
)
from commpress.compressors.registry import available, build, check_params, compressor_class, register_compressor

__all__ = [
    "AllGather",
    "AllReduce",
    "Bucket",
    "Collective",
    "Compressor",
    "Context",
    "ParamSlot",
    "Reduction",
    "available",
    "build",
    "check_params",
    "compressor_class",
    "register_compressor",
]
