"""Quantized reduce-scatter, all-reduce and all-gather over a :class:`Wire` payload, for the
FSDP2 collectives and FSDP1 hooks; each counts its input bytes and coding seconds."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from commpress.comm.counters import Traffic
from commpress.fsdp.wire import Wire
from commpress.torch_compat import all_gather_single, reduce_scatter_single

__all__ = ["quantized_all_gather", "quantized_all_reduce", "quantized_reduce_scatter"]


def quantized_reduce_scatter(
    wire: Wire,
    rows: torch.Tensor,
    output: torch.Tensor,
    group: dist.ProcessGroup,
    seeds: Sequence[int],
    op: dist.ReduceOp,
    traffic: Traffic,
) -> None:
    """``output`` = AVG or SUM over ranks of their row ``rank`` of ``rows`` (``[world, n]``, row ``r``
    encoded with ``seeds[r]``) via an all-to-all; raw ranges via the ordinary reduce-scatter."""
    world = rows.shape[0]
    t0 = time.perf_counter()
    payloads = torch.empty(world, wire.nbytes, dtype=torch.uint8, device=rows.device)
    for dest in range(world):
        wire.encode(rows[dest], seeds[dest], payloads[dest])
    received = torch.empty_like(payloads)
    t1 = time.perf_counter()
    dist.all_to_all_single(received, payloads, group=group)
    traffic.add(nbytes=payloads.numel(), collectives=1)
    t2 = time.perf_counter()
    wire.accumulate(received, output, average=op == dist.ReduceOp.AVG)
    traffic.add(seconds=t1 - t0 + time.perf_counter() - t2)
    segments = wire.segments
    if segments.nraw:
        raw_in = segments.take(rows, "raw").contiguous()
        raw_out = raw_in.new_empty(segments.nraw)
        reduce_scatter_single(raw_out, raw_in.view(-1), group=group, op=op)
        traffic.add(nbytes=raw_in.numel() * raw_in.element_size(), collectives=1)
        segments.put(output, raw_out, "raw")


def _gathered(wire: Wire, x: torch.Tensor, group: dist.ProcessGroup, seed: int, traffic: Traffic) -> tuple[torch.Tensor, float]:
    """Every rank's payload of flat ``x`` as ``[world, nbytes]`` rows, and the seconds spent encoding."""
    world = group.size()
    t0 = time.perf_counter()
    payload = torch.empty(wire.nbytes, dtype=torch.uint8, device=x.device)
    wire.encode(x, seed, payload)
    gathered = torch.empty(world * wire.nbytes, dtype=torch.uint8, device=x.device)
    t1 = time.perf_counter()
    all_gather_single(gathered, payload, group=group)
    traffic.add(nbytes=wire.nbytes, collectives=1)
    return gathered.view(world, wire.nbytes), t1 - t0


def quantized_all_reduce(wire: Wire, flat: torch.Tensor, group: dist.ProcessGroup, seed: int, traffic: Traffic) -> None:
    """Average ``flat`` over ranks by all-gathering payloads; raw ranges by an ordinary all-reduce."""
    rows, encoding = _gathered(wire, flat, group, seed, traffic)
    t0 = time.perf_counter()
    wire.accumulate(rows, flat, average=True)
    traffic.add(seconds=encoding + time.perf_counter() - t0)
    segments = wire.segments
    if segments.nraw:
        raw = segments.take(flat, "raw").contiguous()
        dist.all_reduce(raw, group=group, op=dist.ReduceOp.AVG)
        traffic.add(nbytes=raw.numel() * raw.element_size(), collectives=1)
        segments.put(flat, raw, "raw")


def quantized_all_gather(
    wire: Wire, shard: torch.Tensor, output: torch.Tensor, group: dist.ProcessGroup, seed: int, traffic: Traffic
) -> None:
    """``output`` (``world * n``) = every rank's dequantized ``shard``, its own included."""
    rows, encoding = _gathered(wire, shard, group, seed, traffic)
    t0 = time.perf_counter()
    out = output.view(rows.shape[0], shard.numel())
    for r in range(rows.shape[0]):
        wire.decode(rows[r], out[r])
    traffic.add(seconds=encoding + time.perf_counter() - t0)
