"""Make this torch look like torch 2.9 to everything but torch itself.

Put this folder first on ``PYTHONPATH`` and every Python process started with it (rank
processes included) hides, on start, each name below that this torch has: code outside
torch that reads one gets AttributeError (or ImportError from ``from ... import``), as on
torch 2.9, while torch's own modules, which call some of them internally, still reach them.
Loaded under any other module name (the tests read ``MODULE_NAMES`` and ``CLASS_NAMES``
this way) it hides nothing.

The names are the public ones (and the private ones commpress reads) in the modules
commpress uses that torch 2.13.0 has and torch 2.9.0 lacks, found by comparing the two
releases' sources.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

#: package -> its functions and classes newer than torch 2.9. Only the packages that
#: re-export them: the modules defining them call them as globals, which a module's
#: ``__getattr__`` cannot serve (tests/test_old_torch.py checks that commpress imports
#: none of these names from anywhere).
MODULE_NAMES: dict[str, tuple[str, ...]] = {
    "torch.distributed": ("all_gather_single", "reduce_scatter_single", "shrink_group"),
    "torch.distributed.fsdp": ("DataParallelMeshDims", "share_comm_ctx"),
}

#: (module, class) -> its attributes newer than torch 2.9 (2.9's FSDPState has one optional
#: ``_fsdp_param_group`` where newer releases keep the list ``_fsdp_param_groups``; 2.9's DDP
#: reads ``broadcast_buffers`` where 2.13 reads ``forward_sync_buffers``)
CLASS_NAMES: dict[tuple[str, str], tuple[str, ...]] = {
    ("torch.distributed.fsdp", "FSDPModule"): (
        "reset_iter_state",
        "set_reduce_scatter_max_input_buffers",
        "set_reduce_scatter_unused_params",
        "set_separate_reduce_scatter_group",
        "set_symm_mem_for_comm",
    ),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState"): ("_fsdp_param_groups",),
    ("torch.nn.parallel", "DistributedDataParallel"): ("forward_sync_buffers",),
}

#: what this process hid (set on start when loaded as ``sitecustomize``)
HIDDEN: list[str] = []


def _from_torch(depth: int) -> bool:
    """Whether the code ``depth`` frames above the caller belongs to torch."""
    name = sys._getframe(depth + 1).f_globals.get("__name__", "")
    return name == "torch" or name.startswith("torch.")


class _TorchOnly:
    """A class attribute that torch's code reaches and other code does not see: a class
    member (``value``) or, without one, an attribute each instance keeps in its ``__dict__``
    (a torch without it then never sets it, and it reads as missing to everyone)."""

    _NONE = object()

    def __init__(self, name: str, value: Any = _NONE) -> None:
        self.name, self.value = name, value

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if not _from_torch(1):
            raise AttributeError(f"{self.name} is newer than torch 2.9 (hidden by tests/torch_2_9)")
        if self.value is not self._NONE:
            return self.value.__get__(obj, owner) if hasattr(self.value, "__get__") else self.value
        if obj is None:
            return self
        try:
            return obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value


def _hide_in_module(module: ModuleType, names: tuple[str, ...]) -> None:
    hidden = {n: module.__dict__.pop(n) for n in names if n in module.__dict__}
    if not hidden:
        return
    before = module.__dict__.get("__getattr__")

    def __getattr__(name: str) -> Any:
        if name in hidden and _from_torch(1):
            return hidden[name]
        if before is not None:
            return before(name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    module.__getattr__ = __getattr__
    HIDDEN.extend(f"{module.__name__}.{n}" for n in hidden)


def _hide_in_class(module_name: str, class_name: str, names: tuple[str, ...]) -> None:
    cls = getattr(importlib.import_module(module_name), class_name)
    for name in names:
        setattr(cls, name, _TorchOnly(name, cls.__dict__.get(name, _TorchOnly._NONE)))
        HIDDEN.append(f"{module_name}.{class_name}.{name}")


def hide() -> None:
    """Hide every name above that this torch has."""
    for module_name, names in MODULE_NAMES.items():
        _hide_in_module(importlib.import_module(module_name), names)
    for (module_name, class_name), names in CLASS_NAMES.items():
        _hide_in_class(module_name, class_name, names)


if __name__ == "sitecustomize":
    hide()
