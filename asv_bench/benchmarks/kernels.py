"""asv benchmarks of the commpress.cuda ops (CPU always, CUDA when a device is present).

Each op runs on one float32 buffer of NUMEL elements; ``copy`` is the plain-copy reference
to read the others against (same bytes). ``python -m commpress.cuda.bench`` prints the same
ops as one table with GB/s and the speed-up over plain torch ops.
"""

import torch

from commpress.cuda import bench

NUMEL = 1 << 22
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
OPS = list(bench.cases(1024, torch.device("cpu")))


class Kernels:
    params = (DEVICES, OPS)
    param_names = ["device", "op"]
    timeout = 300

    def setup(self, device, op):
        self.device = torch.device(device)
        self.ours, self.theirs = bench.cases(NUMEL, self.device)[op]
        self.ours()  # compile / warm up

    def _run(self, fn):
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_commpress(self, device, op):
        self._run(self.ours)

    def time_torch_ops(self, device, op):
        if self.theirs is None:
            raise NotImplementedError  # asv records "n/a": no plain-torch version of this op
        self._run(self.theirs)
