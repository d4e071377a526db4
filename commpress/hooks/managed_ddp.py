"""The DDP model a run under a torchft ``Manager`` registers."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = ["managed_ddp"]

#: PyTorch's once-per-process notice for a DDP with ``find_unused_parameters=True`` that uses all
#: its parameters: a C++ warning on stderr, out of reach of Python's ``warnings`` filters
_UNUSED_NOTICE = b"find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters"
_notice_spent = False


def managed_ddp(module: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
    """``module`` in torch's DDP as torchft's ``DistributedDataParallel`` builds it, without the
    all-reduce hook that one registers (DDP takes one hook only): over ``ProcessGroupDummy``, with
    ``find_unused_parameters=True`` so the buckets are never rebuilt (a rejoining replica's must
    match its peers'), and PyTorch's notice that no parameter was unused kept off stderr."""
    from torchft.process_group import ProcessGroupDummy

    _spend_unused_notice()
    return DistributedDataParallel(module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True, **kwargs)


def _spend_unused_notice() -> None:
    """Fire :data:`_UNUSED_NOTICE` on a throwaway DDP with fd 2 captured, then write back every
    other captured line (another thread's), so that notice alone is dropped for the process."""
    global _notice_spent
    if _notice_spent:
        return
    _notice_spent = True  # before the probe: its managed_ddp() returns here at once
    try:
        saved = os.dup(2)
    except OSError:
        return
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        os.dup2(captured.fileno(), 2)
        try:
            probe = managed_ddp(_Probe())
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
    """One used parameter, made without drawing from torch's random generator (a ``Linear`` would)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight
