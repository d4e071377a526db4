"""A bucket layout's spans as device tensors, made once per layout: a copy from the host waits for
the device's stream, so a bucket's path makes none after its first step."""

from __future__ import annotations

import math

import torch

__all__ = ["Span", "SpanTensors"]

#: (offset, numel) of a tensor in its bucket's buffer
Span = tuple[int, int]


class SpanTensors:
    """Per layout (ascending spans) and device: each span's size, and the spans with the gaps
    between them as runs, each run with its span's index (a gap's: the span count)."""

    def __init__(self) -> None:
        self._made: dict[tuple[torch.device, tuple[Span, ...]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _of(self, spans: list[Span], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (device, tuple(spans))
        if key not in self._made:
            runs, owners, end = [], [], spans[0][0]
            for i, (offset, numel) in enumerate(spans):
                if offset > end:
                    runs.append(offset - end)
                    owners.append(len(spans))
                runs.append(numel)
                owners.append(i)
                end = offset + numel
            sizes = torch.tensor([n for _, n in spans], dtype=torch.float64, device=device)
            self._made[key] = (sizes, torch.tensor(owners, device=device), torch.tensor(runs, device=device))
        return self._made[key]

    def sizes(self, spans: list[Span], device: torch.device) -> torch.Tensor:
        """Each span's element count, float64."""
        return self._of(spans, device)[0]

    def spoil(self, buffer: torch.Tensor, spans: list[Span], ok: torch.Tensor) -> None:
        """NaN into each span whose flag in ``ok`` (bool, one per span, on the buffer's device) is
        False, with no host read: each run's flag repeated over its length (a gap's is True)."""
        _, owners, runs = self._of(spans, ok.device)
        start, stop = spans[0][0], spans[-1][0] + spans[-1][1]
        keep = torch.cat([ok, ok.new_ones(1)]).index_select(0, owners)
        bad = torch.repeat_interleave(torch.logical_not(keep), runs, output_size=stop - start)
        buffer.narrow(0, start, stop - start).masked_fill_(bad, math.nan)
