"""The CPU implementation of the kernels: compiled loops (numba), one module per op family.

``rng`` (SplitMix64, uniforms, seed folding), ``bitpack``, ``ternary`` (TernGrad),
``quantize`` (b-bit buckets), ``stats`` (span statistics) and ``topk`` (selection and
decode) each hold their numba kernels and the entry points that take torch tensors;
``_chunks`` splits a call over threads and ``openmp`` says how torch's OpenMP workers wait.
The arithmetic is the CUDA kernels' step for step (SplitMix64 on uint64 words, one IEEE
float32 operation per step), so both give the same bits.

Importing a kernel module imports numba; the front ends of :mod:`commpress.kernels` do it
on the first CPU call, so ``import commpress`` does not. numba's on-disk cache of a kernel
is keyed by its own module's source: after editing ``rng.py`` or ``bitpack.py``, whose
kernels the other modules inline, delete the ``__pycache__`` beside them.
"""
