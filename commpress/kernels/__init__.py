"""The compressors' hot-path kernels: one front end per op, with a CUDA and a CPU implementation.

Each function checks its arguments and dispatches on the tensors' device to the CuPy kernels of
:mod:`commpress.kernels.cuda` or the numba loops of :mod:`commpress.kernels.cpu` (each imported on
first use). Both give the same bits for the same inputs and seed, so CPU and GPU ranks interoperate.
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
