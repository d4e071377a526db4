"""Hot-path kernels of the compressors, with a CPU path that is their exact oracle.

Every function takes torch tensors and dispatches on their device: CPU tensors run
vectorized numpy/torch code in cache-sized blocks, CUDA tensors run CuPy kernels (compiled
from the ``.cu`` sources in ``kernels/``) on torch's current stream. Both produce the same
bits for the same inputs and seed, so a CPU rank and a GPU rank can exchange payloads.
Only this package imports CuPy, and only when a CUDA tensor arrives.
"""

from .bitpack import pack_bits, packed_size, unpack_bits
from .feedback import add_error, update_error
from .quantize import dequantize, quantize_pack, unpack_accumulate
from .rng import derive_seed, uniform
from .ternary import ternary_quantize_pack, ternary_unpack_accumulate
from .topk import scatter_add_decode, topk_select

__all__ = [
    "add_error",
    "dequantize",
    "derive_seed",
    "pack_bits",
    "packed_size",
    "quantize_pack",
    "scatter_add_decode",
    "ternary_quantize_pack",
    "ternary_unpack_accumulate",
    "topk_select",
    "uniform",
    "unpack_accumulate",
    "unpack_bits",
    "update_error",
]
