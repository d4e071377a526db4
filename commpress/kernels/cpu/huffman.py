"""Byte-wise Huffman coding on the CPU (numba): each chunk of bytes with its own code.

Canonical codes of at most ``MAX_BITS`` bits, LSB first, decoded by one table lookup of ``MAX_BITS``
bits; the decoder reports a body that is not exactly a code of its chunk instead of reading past it.
"""

from __future__ import annotations

import numpy as np

from . import _chunks
from ._jit import jit

__all__ = ["MAX_BITS", "decode", "encode"]

#: The longest code: 2**11 table entries per chunk to decode, and room for 256 symbols.
MAX_BITS = 11


@jit
def _tree_lengths(freq, lengths):
    """Unlimited Huffman code lengths of the symbols with ``freq > 0`` (two-queue construction)."""
    symbols = np.nonzero(freq)[0]
    n = symbols.size
    if n == 1:
        lengths[symbols[0]] = 1
        return
    order = symbols[np.argsort(freq[symbols], kind="mergesort")]
    weight = np.empty(2 * n - 1, np.int64)
    parent = np.zeros(2 * n - 1, np.int64)
    weight[:n] = freq[order]
    leaf, node = 0, n
    pair = np.empty(2, np.int64)
    for new in range(n, 2 * n - 1):
        for k in range(2):
            if leaf < n and (node >= new or weight[leaf] <= weight[node]):
                pair[k] = leaf
                leaf += 1
            else:
                pair[k] = node
                node += 1
        weight[new] = weight[pair[0]] + weight[pair[1]]
        parent[pair[0]] = new
        parent[pair[1]] = new
    depth = np.zeros(2 * n - 1, np.int64)
    for i in range(2 * n - 3, -1, -1):  # parents are created after their children
        depth[i] = depth[parent[i]] + 1
    for i in range(n):
        lengths[order[i]] = depth[i]


@jit
def _chunk_lengths(chunk, lengths):
    """Code lengths (0 for absent bytes) of non-empty ``chunk``: Huffman's cut to MAX_BITS, the Kraft sum
    restored by lengthening the rarest short codes, then the commonest shortened while it stays <= 1."""
    freq = np.zeros(256, np.int64)
    for b in chunk:
        freq[b] += 1
    full = np.zeros(256, np.int64)
    _tree_lengths(freq, full)
    limit = 1 << MAX_BITS
    kraft = 0
    for s in range(256):
        full[s] = min(full[s], MAX_BITS)
        if full[s]:
            kraft += limit >> full[s]
    rare = np.argsort(freq, kind="mergesort")
    while kraft > limit:
        for s in rare:
            if 0 < full[s] < MAX_BITS and kraft > limit:
                kraft -= limit >> (full[s] + 1)
                full[s] += 1
    for k in range(255, -1, -1):
        s = rare[k]
        while full[s] > 1 and kraft + (limit >> full[s]) <= limit:
            kraft += limit >> full[s]
            full[s] -= 1
    for s in range(256):
        lengths[s] = full[s]


@jit
def _reversed_codes(lengths):
    """Each symbol's canonical code, bit-reversed for the LSB-first stream."""
    count = np.zeros(MAX_BITS + 1, np.int64)
    for s in range(256):
        count[lengths[s]] += 1
    count[0] = 0
    next_code = np.zeros(MAX_BITS + 1, np.int64)
    code = 0
    for bits in range(1, MAX_BITS + 1):
        code = (code + count[bits - 1]) << 1
        next_code[bits] = code
    codes = np.zeros(256, np.uint64)
    for s in range(256):
        bits = lengths[s]
        if bits:
            c = next_code[bits]
            next_code[bits] += 1
            r = 0
            for _ in range(bits):
                r = (r << 1) | (c & 1)
                c >>= 1
            codes[s] = r
    return codes


@jit
def _encode_chunk(chunk, lengths, out):
    """Code ``chunk`` into ``out`` (room for MAX_BITS bits a byte plus 4 bytes); return the bytes written."""
    codes = _reversed_codes(lengths)
    acc = np.uint64(0)
    filled = 0
    pos = 0
    for b in chunk:
        acc |= codes[b] << np.uint64(filled)
        filled += lengths[b]
        if filled >= 32:
            for _ in range(4):
                out[pos] = np.uint8(acc & np.uint64(0xFF))
                acc >>= np.uint64(8)
                pos += 1
            filled -= 32
    while filled > 0:
        out[pos] = np.uint8(acc & np.uint64(0xFF))
        acc >>= np.uint64(8)
        pos += 1
        filled -= 8
    return pos


@jit
def _table(lengths):
    """Decoding tables of ``MAX_BITS``-bit windows, entries ``first | second << 8 | count << 16 |
    length << 20`` (0: no code starts): ``one`` a symbol each, ``table`` two where both fit."""
    codes = _reversed_codes(lengths)
    size = 1 << MAX_BITS
    one = np.zeros(size, np.int32)  # symbol | 1 << 16 | length << 20
    for s in range(256):
        bits = lengths[s]
        if bits:
            for high in range(0, size, 1 << bits):
                one[high | codes[s]] = s | (1 << 16) | (bits << 20)
    table = one.copy()
    for window in range(size):
        used = one[window] >> 20
        if used:
            second = one[window >> used]
            total = used + (second >> 20)
            if second and total <= MAX_BITS:
                table[window] = (one[window] & 0xFF) | ((second & 0xFF) << 8) | (2 << 16) | (total << 20)
    return one, table


@jit
def _decode_chunk(body, lengths, out):
    """``out.size`` symbols from ``body``; False unless ``body`` is exactly their code."""
    one, table = _table(lengths)
    mask = np.uint64((1 << MAX_BITS) - 1)
    acc = np.uint64(0)
    filled = 0
    pos = 0
    i = 0
    n = out.size
    while i < n:
        if filled < MAX_BITS:
            while filled <= 56 and pos < body.size:
                acc |= np.uint64(body[pos]) << np.uint64(filled)
                pos += 1
                filled += 8
        entry = table[acc & mask] if i + 1 < n else one[acc & mask]
        total = entry >> 20
        if total == 0 or total > filled:
            return False
        out[i] = np.uint8(entry & 0xFF)
        if i + 1 < n:
            out[i + 1] = np.uint8((entry >> 8) & 0xFF)  # the second symbol, or 0 overwritten next
        i += (entry >> 16) & 3
        acc >>= np.uint64(total)
        filled -= total
    return pos == body.size and filled < 8 and acc == 0  # every byte read, and only zero padding left


def _valid_lengths(lengths: np.ndarray) -> bool:
    """Whether every row of lengths has a code, none over MAX_BITS, and Kraft's sum at most 1."""
    if lengths.size and lengths.max() > MAX_BITS:
        return False
    kraft = np.where(lengths > 0, (1 << MAX_BITS) >> lengths.astype(np.int64), 0).sum(axis=1)
    return bool(((kraft > 0) & (kraft <= 1 << MAX_BITS)).all())


def encode(raw: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Chunks of ``raw``: their code lengths (uint8[chunks, 256]), body sizes (int64) and bodies."""
    starts = list(range(0, raw.size, chunk))
    lengths = np.zeros((len(starts), 256), np.uint8)

    def one(k: int, start: int) -> np.ndarray:
        piece = raw[start : start + chunk]
        _chunk_lengths(piece, lengths[k])
        body = np.empty(piece.size * MAX_BITS // 8 + 8, np.uint8)
        return body[: _encode_chunk(piece, lengths[k], body)]

    bodies = _chunks.map_blocks(one, list(enumerate(starts)))
    return lengths, np.array([b.size for b in bodies], np.int64), bodies


def decode(lengths: np.ndarray, bodies: list[np.ndarray], chunk: int, out: np.ndarray) -> str | None:
    """Decode :func:`encode`'s ``lengths`` and ``bodies`` into ``out``: None, or what is wrong. The
    lengths are checked first, since the tables are built from them unchecked."""
    if len(bodies) != -(-out.size // chunk) or lengths.shape != (len(bodies), 256):
        return f"holds {len(bodies)} chunks where {out.size} bytes need {-(-out.size // chunk)}"
    if not _valid_lengths(lengths):
        return f"has code lengths that are not a prefix code of at most {MAX_BITS} bits"

    def one(k: int) -> bool:
        return bool(_decode_chunk(bodies[k], lengths[k], out[k * chunk : (k + 1) * chunk]))

    if not all(_chunks.map_blocks(one, [(k,) for k in range(len(bodies))])):
        return f"does not decode to {out.size} bytes: not a frame of this coder"
    return None
