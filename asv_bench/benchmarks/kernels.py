"""asv benchmarks of the commpress.kernels ops (CPU always, CUDA when a device is present).

Each op runs on one float32 buffer of NUMEL elements; ``copy`` is the plain-copy reference
to read the others against (same bytes). ``python -m commpress.bench.kernels`` prints the same
ops as one table with GB/s and the speed-up over plain torch ops.
"""

import torch

from commpress.bench import kernels as bench

NUMEL = 1 << 22
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
_CASES = bench.cases(1024, torch.device("cpu"))
OPS = list(_CASES)
#: The ops that also have a plain-torch version to compare with.
TORCH_OPS = [name for name, (_, theirs) in _CASES.items() if theirs is not None]


class _Op:
    """Set-up shared by both classes: the op's call on NUMEL elements of ``device``."""

    param_names = ["device", "op"]
    timeout = 300
    which = 0  # 0: commpress call, 1: plain-torch call

    def setup(self, device, op):
        self.device = torch.device(device)
        self.fn = bench.cases(NUMEL, self.device)[op][self.which]
        self.fn()  # compile / warm up

    def _run(self):
        self.fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()


class Kernels(_Op):
    """Each commpress.kernels op."""

    params = (DEVICES, OPS)

    def time_commpress(self, device, op):
        self._run()


class KernelsTorch(_Op):
    """The same computation in plain torch ops, for the ops that have one."""

    params = (DEVICES, TORCH_OPS)
    which = 1

    def time_torch_ops(self, device, op):
        self._run()
