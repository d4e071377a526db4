"""What pickles, and what refuses to.

Hook states (the DDP hook's ``CommState``, the FSDP1 hook states) may be built before the
process group and handed to a framework that pickles them into the processes it spawns
(Lightning's ``ddp_spawn``), or pickled with a checkpoint, as PyTorch's ``PowerSGDState``
is: they travel without their process group and the copy connects to the default group
at its first use. A state of another group refuses, since its copy would reduce over the
wrong ranks. Trainers bound to this process's model and optimizer (Local SGD, CO2, DiLoCo,
1-bit Adam, the parameter averager, FSDP2's state) refuse to pickle: a copy could reach
none of what they drive, and their checkpoint is ``state_dict()``.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["BoundToProcess", "check_default_group"]


class BoundToProcess:
    """Base of objects bound to this process's model, optimizer or process group: pickling
    (and ``copy``) raises ``TypeError`` saying to save ``state_dict()`` instead."""

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} does not pickle: it drives this process's model, optimizer and process group, "
            "which a copy could not reach; save its state_dict() (with the model's and the optimizer's) and "
            f"load_state_dict() into a {type(self).__name__} built in the new process"
        )


def check_default_group(group: Any, what: str) -> None:
    """Refuse to pickle ``what``, a hook state of ``group``, unless ``group`` is the default
    one (None, or the world group): its copy connects to the default group."""
    if group is None:
        return
    import torch.distributed as dist

    if not (dist.is_initialized() and group is dist.group.WORLD):
        raise TypeError(
            f"{what} of a process group other than the default one does not pickle: its copy connects to the "
            "default group, and would reduce over other ranks; build the state in each process, or save its "
            "state_dict() and load it into a new one"
        )
