"""Which implementation runs the CPU paths: compiled loops (numba) or vectorized numpy.

Both give the same bits (the tests compare them on odd sizes, offsets and every bit width).
numba is a dependency of the package and the default: one fused pass per block, no
full-size temporaries, several times faster. The numpy path runs when numba cannot be
imported (a platform without its wheels), with a warning saying so, or when chosen with
``COMMPRESS_CPU_BACKEND=numpy``. :func:`cpu_backend` names the one in use.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

from commpress.errors import ConfigError

ENV = "COMMPRESS_CPU_BACKEND"
CHOICES = ("auto", "numba", "numpy")

_active: tuple[str, ModuleType | None] | None = None  # (name, the compiled kernels module or None)


def _choose() -> tuple[str, ModuleType | None]:
    wanted = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if wanted not in CHOICES:
        raise ConfigError(f"{ENV}={os.environ[ENV]!r} is not accepted; accepted values: {', '.join(CHOICES)}")
    if wanted == "numpy":
        return "numpy", None
    try:
        from . import _numba
    except ImportError as exc:
        if wanted == "numba":
            raise RuntimeError(f"{ENV}=numba but numba cannot be imported ({exc}); pip install numba") from exc
        warnings.warn(
            f"commpress: numba cannot be imported ({exc}); the CPU kernels run the numpy path, several times slower "
            f"(pip install numba, or set {ENV}=numpy to silence this)",
            RuntimeWarning,
            stacklevel=3,
        )
        return "numpy", None
    return "numba", _numba


def compiled() -> ModuleType | None:
    """The compiled kernels module when the numba backend is active, else None (numpy path)."""
    global _active
    if _active is None:
        _active = _choose()
    return _active[1]


def cpu_backend() -> str:
    """The CPU backend in use: ``"numba"`` (compiled, the default) or ``"numpy"``.

    Chosen once per process from ``COMMPRESS_CPU_BACKEND`` (auto, numba or numpy; auto
    takes numba when it imports).
    """
    compiled()
    assert _active is not None
    return _active[0]


def reset() -> None:
    """Forget the choice, so the next call reads ``COMMPRESS_CPU_BACKEND`` again (tests)."""
    global _active
    _active = None
