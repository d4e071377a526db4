# Sourced by run.sh: ft_race_2026-11-27c's row on linkemu (3 ranks, 100 Mbit/s, its `run`),
# writing into this folder.
source "$(dirname "${BASH_SOURCE[0]}")/../ft_race_2026-11-27c/common.sh"
D=benchmarks/results/ft_race_2026-11-29b
