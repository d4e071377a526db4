"""What pickles, and what refuses to.

Hook states may be pickled into spawned processes (Lightning's ``ddp_spawn``) or with a
checkpoint, as ``PowerSGDState`` is: they travel without their process group and the copy
connects to the default group (so a state of another group refuses). Trainers bound to this
process's model and optimizer refuse: a copy could reach none of it; use ``state_dict()``.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["BoundToProcess", "check_default_group"]


class BoundToProcess:
    """Base of objects bound to this process: pickling (and ``copy``) raises ``TypeError``."""

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} does not pickle: it drives this process's model, optimizer and process group, "
            "which a copy could not reach; save its state_dict() (with the model's and the optimizer's) and "
            f"load_state_dict() into a {type(self).__name__} built in the new process"
        )


def check_default_group(group: Any, what: str) -> None:
    """Refuse to pickle ``what``, a hook state of ``group``, unless that is the default group."""
    if group is None:
        return
    import torch.distributed as dist

    if not (dist.is_initialized() and group is dist.group.WORLD):
        raise TypeError(
            f"{what} of a process group other than the default one does not pickle: its copy connects to the "
            "default group, and would reduce over other ranks; build the state in each process, or save its "
            "state_dict() and load it into a new one"
        )
