"""The CUDA implementation of the kernels: the ``.cu`` sources beside this file and their launchers.

``_cupy`` loads CuPy and compiles a source with NVRTC on first use (``--fmad=false``, so no
multiply-add is contracted); ``_launch`` allocates outputs with torch and runs the kernels
on torch's current stream. Only this package imports CuPy, and only when a CUDA tensor
reaches a front end of :mod:`commpress.kernels`.
"""
