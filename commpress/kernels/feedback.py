"""Error-feedback arithmetic: ``acc = grad + error`` and ``error = acc - decoded``.

One float32 add or subtract per element: a torch elementwise op is already fused and gives the
same bits on CPU and CUDA, so no custom kernel. NaNs propagate; the compressor handles them.
"""

from __future__ import annotations

import torch

from . import _checks

__all__ = ["add_error", "update_error"]


def add_error(grad: torch.Tensor, error: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``grad + error`` in float32 (into ``out`` if given; ``out`` may be ``error``)."""
    _checks.check_float("grad", grad)
    _checks.check_dtype("error", error, torch.float32)
    _checks.check_same_device(grad=grad, error=error)
    if grad.numel() != error.numel():
        raise ValueError(f"grad has {grad.numel()} elements, error has {error.numel()}")
    grad = grad.reshape(error.shape)
    if out is None:
        return torch.add(error, grad)
    _checks.check_dtype("out", out, torch.float32)
    _checks.check_same_device(grad=grad, out=out)
    return torch.add(error, grad, out=out.view(error.shape)).view(out.shape)


def update_error(acc: torch.Tensor, decoded: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """Set ``error = acc - decoded`` in place (float32) and return it."""
    _checks.check_dtype("acc", acc, torch.float32)
    _checks.check_float("decoded", decoded)
    _checks.check_dtype("error", error, torch.float32)
    _checks.check_same_device(acc=acc, decoded=decoded, error=error)
    if not acc.numel() == decoded.numel() == error.numel():
        raise ValueError(f"acc, decoded and error differ in size: {acc.numel()}, {decoded.numel()}, {error.numel()}")
    return torch.sub(acc.view(error.shape), decoded.reshape(error.shape), out=error)
