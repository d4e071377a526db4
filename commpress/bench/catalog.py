"""What the benchmark commands can be asked for, by name: workloads, quality tasks,
optimizers and quality rows.

Plain names without their models, so a command lists them in ``--help`` and checks its
command line before it loads torch; :mod:`commpress.bench.workloads` and
:mod:`commpress.bench.quality` hold what each name runs.
"""

from __future__ import annotations

from commpress.workloads import SHAPE_SETS

__all__ = ["LAYERWISE_OF", "METHODS", "OPTIMIZERS", "TASKS", "WORKLOADS"]

#: ``commpress bench --workload``: the shaped models and the demo's character model.
WORKLOADS = (*SHAPE_SETS, "charlm")
#: ``commpress quality --tasks``: the demo's character MLP, a conv net on generated images,
#: a tiny transformer, a small ResNet (BatchNorm, residual blocks) on larger generated images.
TASKS = ("charlm", "shapes", "transformer", "resnet")
#: Optimizers by name: SGD with momentum 0.9, AdamW (weight decay 0.01), and Muon on the
#: hidden matrices with AdamW on the rest (:mod:`commpress.bench.optimizers`), each under a
#: cosine schedule from the task's base learning rate.
OPTIMIZERS = ("sgd", "adamw", "muon")
#: Quality rows by label, in table order.
METHODS = (
    "none",
    "fp16",
    "bf16",
    "powersgd",
    "acpsgd",
    "terngrad",
    "terngrad-last",
    "topk",
    "topk-dgc",
    "local-sgd+qsr",
    "co2",
    "diloco",
    "streaming-diloco",
    "qsdp-w8g8",
    "topk-layerwise",
    "topk-dgc-layerwise",
    "terngrad-layerwise",
    "powersgd-layerwise",
    "acpsgd-layerwise",
    "onebit-adam",
)
#: The rows a ``-layerwise`` row plans per tensor (``[layerwise]``, at the row's own bytes).
LAYERWISE_OF = ("topk", "topk-dgc", "terngrad", "powersgd", "acpsgd")
