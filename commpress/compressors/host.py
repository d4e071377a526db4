"""The deliberate transfers between a compressor's device and the host, in one place.

Compressors keep their work on the gradient's device; the few values that must cross (flags a
step branches on, sizes, checkpoint tensors) go through these functions, which tests running
compressors on fake devices patch.
"""

from __future__ import annotations

import torch

__all__ = ["finite", "flags", "numbers", "reads_stall", "to_device", "to_host"]


def finite(*tensors: torch.Tensor, bound: float | None = None) -> torch.Tensor:
    """A 0-d bool tensor on the device: no Inf or NaN in any of ``tensors`` and, with ``bound``, no
    magnitude above it. One ``aminmax`` pass each (min and max propagate NaN), cheaper than
    ``isfinite(t).all()`` and its bool temporary."""
    flag = torch.ones((), dtype=torch.bool, device=tensors[0].device)
    for t in tensors:
        if t.numel():
            lo, hi = torch.aminmax(t)
            flag = flag & torch.isfinite(lo) & torch.isfinite(hi)
            if bound is not None:
                flag = flag & (lo >= -bound) & (hi <= bound)
    return flag


def flags(t: torch.Tensor) -> list[bool]:
    """The values of the boolean tensor ``t`` (any shape, read flat) on the host: one sync."""
    return [bool(v) for v in t.reshape(-1).tolist()]


def numbers(t: torch.Tensor) -> list[float]:
    """The values of ``t`` (any shape, read flat) on the host as floats: one sync."""
    return [float(v) for v in t.reshape(-1).tolist()]


def reads_stall(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values on the host waits for its device (anything but a CPU tensor):
    there a compressor keeps its checks on the device for the step's one read."""
    return t.device.type != "cpu"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (a checkpoint tensor meeting its gradient after a resume)."""
    return t.to(device)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t``, detached (what a checkpoint stores)."""
    return t.detach().to("cpu", copy=True)
