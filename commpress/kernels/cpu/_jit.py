"""What the compiled CPU kernels share: numba's decorators and the size of their scratch pieces.

Every kernel releases the GIL (``nogil``), is compiled on first use and cached on disk
(``cache=True``), and uses numpy's error model (a division by zero gives Inf or NaN, as in
float32 arithmetic). No fast-math: no reassociation and no fused multiply-add, so each step
is the one IEEE float32 operation the CUDA kernels perform.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["NONE", "ONE", "PIECE", "ZERO", "inline", "jit"]

jit = njit(nogil=True, cache=True, error_model="numpy")
inline = njit(nogil=True, cache=True, error_model="numpy", inline="always")

PIECE = 4096  # elements per scratch piece (a multiple of 8: whole bytes at every bit width)
NONE = np.empty(0, np.float32)  # "no addend" for the kernels that may add one
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
