"""Hot-path kernels of the compressors, with a CPU path that is their exact oracle.

Every function takes torch tensors and dispatches on their device: CPU tensors run compiled
numba loops (one fused pass per span; vectorized numpy code in cache-sized blocks where numba
is missing, see :func:`cpu_backend`), CUDA tensors run CuPy kernels (compiled from the ``.cu``
sources in ``kernels/``) on torch's current stream. Both produce the same
bits for the same inputs and seed, so a CPU rank and a GPU rank can exchange payloads.
Only this package imports CuPy, and only when a CUDA tensor arrives.
"""

from ._backend import cpu_backend
from .bitpack import pack_bits, packed_size, unpack_bits
from .feedback import add_error, update_error
from .quantize import dequantize, quantize_pack, unpack_accumulate
from .rng import derive_seed, uniform
from .stats import span_stats
from .ternary import ternary_quantize_pack, ternary_unpack_accumulate
from .ternary_many import ternary_quantize_pack_many, ternary_unpack_accumulate_many
from .topk import scatter_add_decode, topk_select, topk_select_many

__all__ = [
    "add_error",
    "cpu_backend",
    "dequantize",
    "derive_seed",
    "pack_bits",
    "packed_size",
    "quantize_pack",
    "scatter_add_decode",
    "span_stats",
    "ternary_quantize_pack",
    "ternary_quantize_pack_many",
    "ternary_unpack_accumulate",
    "ternary_unpack_accumulate_many",
    "topk_select",
    "topk_select_many",
    "uniform",
    "unpack_accumulate",
    "unpack_bits",
    "update_error",
]
