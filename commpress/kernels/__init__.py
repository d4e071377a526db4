"""The compressors' hot-path kernels: one front end per op, a CUDA and a CPU implementation.

Every function takes torch tensors, checks its arguments and dispatches on their device:
CUDA tensors run the CuPy kernels of :mod:`commpress.kernels.cuda` (compiled from its
``.cu`` sources) on torch's current stream; CPU tensors run the compiled numba loops of
:mod:`commpress.kernels.cpu` (one fused pass per span, spread over torch's thread count).
Both produce the same bits for the same inputs and seed, so a CPU rank and a GPU rank can
exchange payloads. Only :mod:`commpress.kernels.cuda` imports CuPy, and only when a CUDA
tensor arrives; numba is imported when the first CPU tensor (or seed) arrives.
"""

from .bitpack import pack_bits, packed_size, unpack_bits
from .feedback import add_error, update_error
from .huffman import huffman_decode, huffman_encode
from .quantize import dequantize, quantize_pack, unpack_accumulate
from .rng import derive_seed, uniform
from .sign import sign_pack_many, sign_unpack_accumulate_many
from .stats import span_stats
from .ternary import ternary_quantize_pack, ternary_unpack_accumulate
from .ternary_many import ternary_quantize_pack_many, ternary_unpack_accumulate_many
from .topk import scatter_add_decode, topk_select, topk_select_many

__all__ = [
    "add_error",
    "dequantize",
    "derive_seed",
    "huffman_decode",
    "huffman_encode",
    "pack_bits",
    "packed_size",
    "quantize_pack",
    "scatter_add_decode",
    "sign_pack_many",
    "sign_unpack_accumulate_many",
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
