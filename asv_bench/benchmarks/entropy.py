"""The wire's entropy coder (``commpress.kernels.huffman``) beside zlib's Huffman-only deflate,
on TernGrad's codes of 4M Gaussian values (``entropy = true``'s payload)."""

from __future__ import annotations

import zlib

import torch

from commpress.kernels import huffman_decode, huffman_encode, ternary_quantize_pack

NUMEL = 1 << 22


class EntropyCoding:
    """Coding and decoding one payload of 1 MiB of 2-bit codes, about a third nonzero."""

    params = (["huffman", "zlib"],)
    param_names = ("coder",)
    timeout = 120

    def setup(self, coder: str) -> None:
        x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
        bound = (2.5 * x.square().mean().sqrt()).reshape(1)
        self.payload = ternary_quantize_pack(x, bound.reshape(()), 0, bound=bound)
        self.raw = self.payload.numpy().tobytes()
        self.frame = huffman_encode(self.payload)
        huffman_decode(self.frame, self.payload.numel())  # both compiled before the timing
        self.deflated = self._deflate()

    def _deflate(self) -> bytes:
        coder = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
        return coder.compress(self.raw) + coder.flush()

    def time_encode(self, coder: str) -> None:
        huffman_encode(self.payload) if coder == "huffman" else self._deflate()

    def time_decode(self, coder: str) -> None:
        if coder == "huffman":
            huffman_decode(self.frame, self.payload.numel())
        else:
            zlib.decompress(self.deflated, -15, len(self.raw))

    def track_bits_a_value(self, coder: str) -> float:
        return 8 * (self.frame.numel() if coder == "huffman" else len(self.deflated)) / NUMEL
