"""SplitMix64 on the CPU (numba), as :mod:`commpress.kernels.rng` defines it: the CPU kernels'
random stream and the seed derivation, on uint64 words with wrapping multiplies."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from commpress.kernels._constants import GAMMA, MIX1, MIX2, SEED_BASIS

from . import _chunks
from ._jit import ONE, PIECE, inline, jit

__all__ = ["fill_uniform_tensor", "fold_chain", "fold_each"]

_GAMMA = np.uint64(GAMMA)
_MIX1 = np.uint64(MIX1)
_MIX2 = np.uint64(MIX2)
_BASIS = np.uint64(SEED_BASIS)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)
_M23 = np.uint64(0x7FFFFF)
_ULP23 = np.float32(2.0**-23)  # uniform = 23 random bits * 2**-23, exact in float32
_M23X2 = np.uint64(0x007FFFFF007FFFFF)  # the low 23 bits of both halves of a word
_ONEX2 = np.uint64(0x3F8000003F800000)  # 1.0f in both halves


@inline
def mix(z):
    """SplitMix64's output function."""
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


@inline
def word(seed, c):
    """SplitMix64 word ``c`` (uint64) of stream ``seed``."""
    return mix(seed + c * _GAMMA)


@inline
def fold(h, v):
    """One step of ``derive_seed``: the key so far ``h`` with the uint64 ``v`` folded in."""
    return mix((h ^ v) + _GAMMA)


@inline
def derive2(seed, widen):
    """``derive_seed(seed, widen)`` of two uint64 values."""
    return fold(fold(_BASIS, seed), np.uint64(widen))


@inline
def unit(bits):
    """The uniform in [0, 1) built from the low 23 bits of a draw (uint64 holding the draw)."""
    return np.float32(bits & _M23) * _ULP23


@inline
def unit_pairs(seed, c, words):
    """``words[j]``: word ``c + j`` of stream ``seed`` as two float32 in [1, 2) (low draw first),
    each draw's 23 bits under 1.0's exponent, so ``value - 1`` is its uniform exactly."""
    z = seed + c * _GAMMA
    for j in range(words.size):
        words[j] = (mix(z) & _M23X2) | _ONEX2
        z += _GAMMA


@inline
def words_of(seed, words):
    """``words[j]`` = word ``j`` of stream ``seed`` (its uint32 halves are draws ``2j`` and ``2j + 1``)."""
    z = seed
    for j in range(words.size):
        words[j] = mix(z)
        z += _GAMMA


@inline
def _minus_one(src, out):
    for t in range(out.size):
        out[t] = src[t] - ONE


@jit
def fill_uniform(out, seed, offset):
    """``out[i]`` = uniform ``offset + i`` of stream ``seed`` (float32 out, uint64 seed, int offset)."""
    m = out.size
    i = 0
    if m > 0 and offset & 1:
        out[0] = unit(word(seed, np.uint64(offset >> 1)) >> _S32)
        i = 1
    buf = np.empty(PIECE, np.float32)
    words = buf.view(np.uint64)
    for ps in range(i, m, PIECE):
        pe = min(m, ps + PIECE)
        unit_pairs(seed, np.uint64((offset + ps) >> 1), words[: (pe - ps + 1) >> 1])
        _minus_one(buf, out[ps:pe])


@jit
def _fold_chain(h, values):
    for j in range(values.size):
        h = fold(h, values[j])
    return h


@jit
def _fold_each(h, values, out):
    for j in range(values.size):
        out[j] = fold(h, values[j])


def fold_chain(h: int, values: Sequence[int]) -> int:
    """``h`` with every value of ``values`` (ints in [0, 2**64)) folded in, in order."""
    return int(_fold_chain(np.uint64(h), np.array(values, np.uint64)))


def fold_each(h: int, values: Sequence[int]) -> list[int]:
    """``[fold(h, v) for v in values]`` (ints in [0, 2**64))."""
    out = np.empty(len(values), np.uint64)
    _fold_each(np.uint64(h), np.array(values, np.uint64), out)
    return out.tolist()


def fill_uniform_tensor(out: torch.Tensor, seed: int, offset: int) -> None:
    """Fill float32 ``out`` with uniforms ``offset ..`` of stream ``seed``."""
    dst = _chunks.as_numpy(out)
    seed64 = np.uint64(seed)
    _chunks.map_blocks(lambda s, e: fill_uniform(dst[s:e], seed64, offset + s), _chunks.parts(out.numel(), 2))
