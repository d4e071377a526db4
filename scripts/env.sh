# Sourced by scripts/demo and scripts/test: create or reuse .venv and install commpress.
# torch is pinned to 2.13.0 when missing (that pin installs the CPU build on this machine
# class; any other spec would download the multi-gigabyte CUDA build).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${COMMPRESS_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e "$ROOT${EXTRAS:+[$EXTRAS]}"
