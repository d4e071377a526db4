"""The DDP model a run under a torchft ``Manager`` registers: torch's DDP over torchft's
``ProcessGroupDummy`` (every collective goes through the manager, see
:class:`~commpress.hooks.state.CommState`'s ``manager=``), with buckets never rebuilt."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = ["managed_ddp"]

#: PyTorch's reducer says this once per process, at the first forward of a DDP built with
#: ``find_unused_parameters=True`` that uses all its parameters: a C++ warning written to
#: stderr, out of reach of Python's ``warnings`` filters
_UNUSED_NOTICE = b"find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters"
_notice_spent = False


def managed_ddp(module: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
    """``module`` in torch's DDP, ready for :func:`commpress.register` with ``manager=``: over
    torchft's ``ProcessGroupDummy`` (the collectives go through the manager) and with
    buckets never rebuilt (a rejoining replica's buckets must match its peers'), as
    torchft's own ``DistributedDataParallel`` builds it; that one registers its all-reduce
    hook when built, and DDP takes one hook only.

    ``find_unused_parameters=True`` is what keeps the buckets (DDP rebuilds them after the
    first step only without it), as in torchft's wrapper, not a claim that the model has
    unused parameters; so PyTorch's one-time notice that it found none says nothing here and
    is kept off stderr (:func:`_spend_unused_notice`)."""
    from torchft.process_group import ProcessGroupDummy

    _spend_unused_notice()
    return DistributedDataParallel(module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True, **kwargs)


def _spend_unused_notice() -> None:
    """Let PyTorch's find-unused-parameters notice (:data:`_UNUSED_NOTICE`, printed once per
    process) fire on a throwaway one-parameter DDP with stderr captured, then write back
    everything else captured meanwhile (another thread's lines), so that line alone is
    dropped. Once per process; a later DDP of the process with ``find_unused_parameters=True``
    does not print it either (PyTorch's once is the process's). Without a stderr to capture
    (fd 2 closed) the notice is left as it is."""
    global _notice_spent
    if _notice_spent:
        return
    _notice_spent = True
    from torchft.process_group import ProcessGroupDummy

    try:
        saved = os.dup(2)
    except OSError:
        return
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        os.dup2(captured.fileno(), 2)
        try:
            probe = DistributedDataParallel(_Probe(), process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True)
            probe(torch.ones(1)).sum().backward()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        rest = [line for line in captured.read().splitlines(keepends=True) if _UNUSED_NOTICE not in line]
    if rest:
        os.write(2, b"".join(rest))


class _Probe(torch.nn.Module):
    """One parameter, used: what fires the notice. Made without drawing from torch's random
    generator (a ``Linear`` would), so the caller's random stream is left as it was."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight
