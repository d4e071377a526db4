"""The CPU implementation of the kernels: numba loops, one module per op family.

Each module holds its kernels and the entry points that take torch tensors; ``_chunks`` splits a
call over threads. Importing one imports numba. numba's disk cache is keyed by each module's own
source: after editing ``rng.py`` or ``bitpack.py``, whose kernels others inline, delete ``__pycache__``.
"""
