# Sourced by scripts/demo and scripts/test: create or reuse .venv and install exactly the lock
# file's packages (locks/demo.txt or locks/test.txt, refreshed by scripts/lock), then commpress
# itself from this tree without touching its dependencies. torch is locked to 2.13.0, which on
# this machine class is the CPU build on disk. pip's own byte-compiling runs on one core;
# compileall spreads it over all of them (a fresh install's slowest minute), and the files must
# be compiled at install: under PYTHONDONTWRITEBYTECODE nothing writes them later, and an
# uncompiled torch takes 12 s instead of 5 to import in every process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${COMMPRESS_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
LOCK="$ROOT/locks/${EXTRAS:-demo}.txt"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --disable-pip-version-check --no-compile -r "$LOCK"
COMPILED="$VENV/.compiled-$(basename "$LOCK")"  # the lock last compiled: a warm venv skips the 6 s walk
if ! cmp -s "$LOCK" "$COMPILED"; then
    "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null ||
        true  # as under pip: a few files written for newer Pythons (torch's tests) do not compile
    cp "$LOCK" "$COMPILED"
fi
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT"
