#!/usr/bin/env bash
# The demo's bytes and losses before and after issue 70's redesign: the filing commit 2d779c4
# (a worktree) beside this checkout, 60 steps, every demo row; compare.py says whether each
# row's bytes per step and held-out loss are the same to the bit.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=benchmarks/results/demo_before_after_2026-12-03
git worktree add -q /tmp/commpress-2d779c4 2d779c4
(cd /tmp/commpress-2d779c4 && "$OLDPWD/.venv/bin/python" -m commpress demo --steps 60 --json "$OLDPWD/$D/demo_2d779c4.json")
git worktree remove --force /tmp/commpress-2d779c4
.venv/bin/python -m commpress demo --steps 60 --json "$D/demo_after.json"
python3 "$D/compare.py"
