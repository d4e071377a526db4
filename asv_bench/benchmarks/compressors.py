"""Compressor throughput: one rank compressing and decompressing a GPT-2-shaped bucket."""

from __future__ import annotations

import time

import torch

from commpress.comm import SimulatedWorld

from .common import compressor, devices, gpt2_bucket, methods

SCALE = 0.05  # 6.2M parameters, 25 MB of fp32 gradient


class CompressorThroughput:
    """``reduce`` of one bucket on a one-rank world: all of a method's local work (compress,
    decompress, error feedback) plus a copy standing in for the collective."""

    params = (methods(), devices())
    param_names = ("method", "device")
    timeout = 120

    def setup(self, method: str, device: str) -> None:
        self.world = SimulatedWorld(1)
        self.compressor = compressor(method)
        self.source = gpt2_bucket(SCALE, device, seed=0)
        self.bucket = gpt2_bucket(SCALE, device, seed=0)
        self.step = 0
        self._reduce()  # first call allocates per-bucket state

    def _reduce(self) -> None:
        self.bucket.buffer.copy_(self.source.buffer)
        self.world.reduce([self.compressor], [self.bucket], step=self.step)
        self.step += 1
        if self.bucket.buffer.is_cuda:
            torch.cuda.synchronize()

    def time_reduce(self, method: str, device: str) -> None:
        self._reduce()

    def track_gradient_gbps(self, method: str, device: str) -> float:
        """Gradient bytes in (and averaged gradient out) per second, best of 5."""
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            self._reduce()
            best = min(best, time.perf_counter() - t0)
        return self.bucket.buffer.numel() * self.bucket.buffer.element_size() / best / 1e9

    track_gradient_gbps.unit = "GB/s"
