"""Argument checks shared by the kernel front-ends: clear errors before any work starts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, t: torch.Tensor) -> None:
    """Raise TypeError unless ``t`` holds float32, float16 or bfloat16."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; accepted dtypes: float32, float16 or bfloat16")


def check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise TypeError unless ``t`` is a tensor of exactly ``dtype``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}; accepted dtype: {dtype}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Return the common device of ``tensors``; ValueError naming them if they differ."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listed = ", ".join(f"{name} on {d}" for name, d in devices.items())
        raise ValueError(f"tensors must be on one device, got {listed}")
    return first


def check_bits(bits: int, accepted: tuple[int, ...]) -> None:
    """ValueError unless ``bits`` is one of ``accepted``."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in accepted:
        raise ValueError(f"bits={bits!r} is not supported; accepted values: {', '.join(map(str, accepted))}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """ValueError unless ``t.shape == shape``."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")


def check_out(out: torch.Tensor, n: int) -> None:
    """TypeError unless ``out`` is a float tensor, ValueError unless it is contiguous of ``n`` elements."""
    check_float("out", out)
    if out.numel() != n or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of {n} elements, got shape {tuple(out.shape)}")


def check_world(packed: torch.Tensor) -> int:
    """The world size of ``packed`` (a row per rank); ValueError unless it is 2-D with at least one row."""
    if packed.dim() != 2 or packed.shape[0] < 1:
        raise ValueError(f"packed must be 2-D [world >= 1, bytes], got shape {tuple(packed.shape)}")
    return packed.shape[0]


def check_count(name: str, value: int, low: int = 0) -> None:
    """ValueError unless ``value`` is an int >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")


def check_spans(spans: Sequence[tuple[int, int]] | np.ndarray, numel: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths (int64) of ``spans``, int pairs or an int64 ``[T, 2]`` array (which a
    caller with many spans builds once); ValueError naming the first outside ``range(numel)``."""
    if isinstance(spans, np.ndarray):
        if spans.dtype != np.int64 or spans.ndim != 2 or spans.shape[1] != 2:
            raise ValueError(f"spans as an array must be int64 of shape [T, 2], got {spans.dtype} {spans.shape}")
        array = spans
    else:
        bad = next((v for pair in spans for v in pair if type(v) is not int), None)  # bools and floats too
        if bad is not None:
            raise ValueError(f"spans hold {bad!r}; expected (offset, length) pairs of integers >= 0")
        array = np.array(spans, dtype=np.int64).reshape(-1, 2)
    offsets, lengths = array[:, 0].copy(), array[:, 1].copy()
    wrong = (offsets < 0) | (lengths < 0) | (offsets + lengths > numel)
    if wrong.any():
        i = int(np.argmax(wrong))
        raise ValueError(f"span ({offsets[i]}, {lengths[i]}) is not inside the {numel} elements of the buffer")
    return offsets, lengths


def check_bucket(name: str, t: torch.Tensor, spans: Sequence[tuple[int, int]] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`check_spans` of ``spans`` once ``t`` is found to be a flat contiguous float buffer."""
    check_float(name, t)
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a flat contiguous buffer, got shape {tuple(t.shape)}")
    return check_spans(spans, t.numel())


def check_gathered(
    packed: torch.Tensor, scales: torch.Tensor, spans: Sequence[tuple[int, int]] | np.ndarray, out: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, int]:
    """Offsets, lengths and world size for decoding every rank's codes (``packed`` uint8[world,
    bytes], ``scales`` float32) into bucket ``out``; the caller checks its code's exact shapes."""
    check_dtype("packed", packed, torch.uint8)
    check_dtype("scales", scales, torch.float32)
    offsets, lengths = check_bucket("out", out, spans)
    return offsets, lengths, check_world(packed)
