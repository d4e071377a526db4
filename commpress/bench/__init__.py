"""``commpress bench``: methods, workloads, the per-rank measurement and the report."""
