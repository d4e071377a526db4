"""Workloads shared by the demo, the benchmarks and the tests.

The names of the shaped models live here, not in :mod:`commpress.workloads.shaped`, so a
command lists them in its ``--help`` without loading torch.
"""

__all__ = ["SHAPE_SETS"]

#: Workload name -> shape file in ``commpress/workloads/shapes``.
SHAPE_SETS = {"resnet50": "resnet50.json", "bert": "bert_base.json", "gpt2": "gpt2_small.json"}
