"""The CUDA implementation of the kernels: the ``.cu`` sources beside this file, built by ``_cupy``, run by ``_launch``."""
