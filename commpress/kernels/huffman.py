"""Lossless Huffman coding of byte payloads for the wire, one code per chunk.

Packed codes whose symbols are far from equally likely (TernGrad's 2-bit codes) carry fewer bits
than their width; coding each byte by its frequency recovers most of that (docs/quantization.md,
"Entropy-coded codes"). Each chunk of ``CHUNK`` bytes gets its own code, so parts with other
statistics are coded apart, in parallel. A host operation: the coded size depends on the data.

Frame for ``n`` bytes in ``ceil(n / CHUNK)`` chunks, little-endian: ``n`` (int64), each chunk's
256 code lengths as 4-bit values (low nibble first, 128 bytes), each body's size (int32), the bodies.
"""

from __future__ import annotations

import numpy as np
import torch

from . import _checks

__all__ = ["CHUNK", "huffman_decode", "huffman_encode"]

#: Payload bytes per chunk (512 Ki 2-bit codes); each chunk adds ``_HEADER`` bytes.
CHUNK = 1 << 17
_HEADER = 128 + 4  # a chunk's lengths and body size
_SIZE = 8  # the payload's size


def huffman_encode(payload: torch.Tensor) -> torch.Tensor:
    """The frame of ``payload`` (uint8, 1-D, any device), on the host: uint8[frame bytes]."""
    _checks.check_dtype("payload", payload, torch.uint8)
    from .cpu import huffman as cpu

    raw = payload.detach().reshape(-1).cpu().numpy()
    lengths, sizes, bodies = cpu.encode(raw, CHUNK)
    head = np.empty(_SIZE + len(bodies) * _HEADER, np.uint8)
    head[:_SIZE] = np.array([raw.size], "<i8").view(np.uint8)
    nibbles = head[_SIZE : _SIZE + 128 * len(bodies)].reshape(-1, 128)
    np.bitwise_or(lengths[:, 0::2], lengths[:, 1::2] << 4, out=nibbles)
    head[_SIZE + 128 * len(bodies) :] = sizes.astype("<i4").view(np.uint8)
    return torch.from_numpy(np.concatenate([head, *bodies]))


def huffman_decode(frame: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` payload bytes of a :func:`huffman_encode` frame, on the host; RuntimeError if it is not one."""
    _checks.check_dtype("frame", frame, torch.uint8)
    _checks.check_count("size", size)
    from .cpu import huffman as cpu

    data = frame.detach().reshape(-1).cpu().numpy()
    chunks = -(-size // CHUNK)
    head = _SIZE + chunks * _HEADER
    if data.size < head:
        raise RuntimeError(f"a Huffman frame of {size} bytes needs {head} header bytes, got {data.size}")
    coded = int(data[:_SIZE].copy().view("<i8")[0])
    if coded != size:
        raise RuntimeError(f"a Huffman frame of {coded} bytes was to decode to {size}")
    nibbles = data[_SIZE : _SIZE + 128 * chunks].reshape(chunks, 128)
    lengths = np.empty((chunks, 256), np.uint8)
    lengths[:, 0::2], lengths[:, 1::2] = nibbles & 15, nibbles >> 4
    sizes = data[_SIZE + 128 * chunks : head].copy().view("<i4").astype(np.int64)
    ends = head + np.cumsum(sizes)
    if (sizes < 0).any() or (ends[-1] if chunks else head) != data.size:
        said = f"{int(sizes.sum())} bytes in {chunks} chunks" if (sizes >= 0).all() else f"sizes {sizes.tolist()[:8]}"
        raise RuntimeError(f"a Huffman frame's bodies ({said}) do not fill the {data.size - head} bytes after its header")
    bodies = [data[e - s : e] for s, e in zip(sizes, ends)]
    out = np.empty(size, np.uint8)
    wrong = cpu.decode(lengths, bodies, CHUNK, out)
    if wrong:
        raise RuntimeError(f"a Huffman frame {wrong}")
    return torch.from_numpy(out)
