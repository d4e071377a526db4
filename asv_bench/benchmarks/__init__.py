"""asv benchmarks of commpress (run from asv_bench/: see docs/benchmarks.md)."""
