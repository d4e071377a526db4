"""One simulated-world step per method: every rank's reduction of a GPT-2-shaped bucket."""

from __future__ import annotations

from commpress.comm import SimulatedWorld

from .common import compressor, gpt2_bucket, methods

SCALE = 0.01  # 1.2M parameters per rank


class SimulatedStep:
    """``SimulatedWorld(n).reduce`` over n ranks with different gradients."""

    params = (methods(), [2, 4])
    param_names = ("method", "world_size")
    timeout = 120

    def setup(self, method: str, world_size: int) -> None:
        self.world = SimulatedWorld(world_size)
        self.compressors = [compressor(method) for _ in range(world_size)]
        self.sources = [gpt2_bucket(SCALE, "cpu", seed=r) for r in range(world_size)]
        self.buckets = [gpt2_bucket(SCALE, "cpu", seed=r) for r in range(world_size)]
        self.step = 0
        self._step()

    def _step(self) -> None:
        for bucket, source in zip(self.buckets, self.sources):
            bucket.buffer.copy_(source.buffer)
        self.world.reduce(self.compressors, self.buckets, step=self.step)
        self.step += 1

    def time_step(self, method: str, world_size: int) -> None:
        self._step()

    def track_bytes_per_rank(self, method: str, world_size: int) -> float:
        """Bytes one rank sends per step (compression regressions show here)."""
        before = self.world.traffic[0].bytes_sent
        self._step()
        return float(self.world.traffic[0].bytes_sent - before)

    track_bytes_per_rank.unit = "bytes"
