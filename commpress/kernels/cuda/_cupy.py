"""Loading CuPy and the kernel sources; the only module that imports CuPy.

NVRTC compiles a source on first use (CuPy caches it on disk) with ``--fmad=false``: no contracted
multiply-add. Tensors pass as device pointers (no per-launch DLPack cost); kernels run on torch's
current stream, ordered with its work (the caching allocator reuses memory only after that work).
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

import numpy as np
import torch

__all__ = ["kernel", "launch", "pointer", "require_cupy"]

OPTIONS = ("--std=c++17", "--fmad=false")
THREADS = 256
_INCLUDE = re.compile(r'^#include "([a-z_]+\.cuh)"$', re.MULTILINE)


def _extra(cuda_version: str | None) -> str:
    major = (cuda_version or "12").split(".")[0]
    return f"cupy-cuda{major}x" if major in ("12", "13") else "cupy-cuda12x or cupy-cuda13x"


@functools.cache
def require_cupy() -> Any:
    """Import CuPy, or raise RuntimeError naming the extra that installs the matching build."""
    extra = _extra(torch.version.cuda)
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            f"CUDA tensors in commpress.kernels need CuPy: pip install {extra} (commpress's cuda12/cuda13 extra; torch "
            f"here uses CUDA {torch.version.cuda})"
        ) from exc
    cupy_major = cupy.cuda.runtime.runtimeGetVersion() // 1000
    torch_major = int((torch.version.cuda or "0").split(".")[0])
    if torch_major and cupy_major != torch_major:
        raise RuntimeError(
            f"CuPy is built for CUDA {cupy_major} but torch uses CUDA {torch.version.cuda}: "
            f"uninstall cupy-cuda{cupy_major}x and pip install {extra}"
        )
    return cupy


def source(name: str) -> str:
    """The text of ``<name>.cu`` (beside this module) with its local headers inlined (so CuPy's cache key covers them)."""
    folder = resources.files("commpress.kernels.cuda")
    text = (folder / f"{name}.cu").read_text()
    return _INCLUDE.sub(lambda m: (folder / m.group(1)).read_text(), text)


@functools.cache
def _module(name: str, device_index: int) -> Any:
    cupy = require_cupy()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=source(name), options=OPTIONS)
        module.compile()
    return module


def kernel(module: str, function: str, device: torch.device) -> Any:
    """The compiled kernel ``function`` of ``<module>.cu`` for ``device``."""
    return _module(module, device.index if device.index is not None else torch.cuda.current_device()).get_function(function)


def pointer(t: torch.Tensor) -> np.uint64:
    """The device address of contiguous CUDA tensor ``t``, as a kernel's pointer argument
    (a 64-bit value; bfloat16 and the other 16-bit types are raw words to the kernels)."""
    if not t.is_contiguous():
        raise ValueError(f"a kernel argument of shape {tuple(t.shape)} is not contiguous")
    return np.uint64(t.data_ptr())


def launch(
    module: str, function: str, device: torch.device, work: int, args: tuple, block: int = THREADS, grid: int | None = None
) -> None:
    """Run ``function`` on torch's current stream of ``device`` with blocks for ``work`` threads (its
    loops grid-stride over the rest); tensors in ``args`` pass as pointers, others as numpy scalars."""
    if work <= 0:
        return
    cupy = require_cupy()
    if grid is None:
        grid = min(-(-work // block), 65535 * 8)
    index = device.index if device.index is not None else torch.cuda.current_device()
    converted = tuple(pointer(a) if isinstance(a, torch.Tensor) else a for a in args)
    function_ = kernel(module, function, device)
    with cupy.cuda.Device(index), _stream(torch.cuda.current_stream(index).cuda_stream, index):
        function_((grid,), (block,), converted)


@functools.lru_cache(maxsize=64)
def _stream(handle: int, index: int) -> Any:
    """CuPy's view of torch's stream ``handle`` on device ``index`` (made once per stream)."""
    return require_cupy().cuda.ExternalStream(handle, index)
