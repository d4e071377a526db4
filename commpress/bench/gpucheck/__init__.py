"""The GPU check: everything a lent GPU machine should run, in one call of a few minutes.

``scripts/gpu-check OUT`` (:mod:`commpress.bench.gpucheck.__main__`) runs each part in a
process of its own under its own time cap, so a hang costs that part only; each part
writes ``OUT/<part>.json`` and the run ends with ``OUT/gpu-check.json`` (every part's
status, checks and figures) and ``OUT/gpu-check.log``. With ``--dry`` it runs on a
machine without CUDA: what needs a GPU is skipped with the reason, the rest runs at small
sizes. Parts: ``env`` (versions, the GPU), ``tests`` (the CUDA tests), ``kernels``
(throughput against each op's byte limit), ``ddp`` (every method on CUDA against the CPU
run), ``lowrank`` (PowerSGD/ACP-SGD beside PyTorch's hook), ``fsdp`` (QSDP on FSDP2).
"""
