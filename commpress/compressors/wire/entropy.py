"""A payload entropy-coded for its all-gather: lossless, so training is the same bits.

Codes whose symbols are far from equally likely (TernGrad's are mostly zero) carry fewer bits
than their width; Huffman codes per chunk (:mod:`commpress.kernels.huffman`) come close to that
entropy (docs/quantization.md). Coded sizes differ between ranks, so the gather takes two
collectives: the max coded size, then every rank's bytes padded to it, led by their length. Both
carry device tensors (an NCCL-only group takes no other). A payload that does not shrink travels
as it is. A rank left out of the max (a healing torchft replica) may code longer; it sends
length -1, which no rank decodes.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from commpress.compressors import host
from commpress.compressors.wire.collectives import AllGather, AllReduce, Collective
from commpress.kernels import huffman_decode, huffman_encode

__all__ = ["HEADER_BYTES", "coded_gather"]

#: Bytes before each rank's coded payload: its coded length (int32).
HEADER_BYTES = 4
#: The length a frame gives when its rank's bytes did not fit the maximum (see above).
_NOT_SENT = -1


def coded_gather(payload: torch.Tensor) -> Generator[Collective, Any, list[torch.Tensor]]:
    """Every rank's ``payload`` (uint8, 1-D, same size everywhere), like ``yield AllGather(payload)``."""
    mine = payload.detach().reshape(-1)
    coded = huffman_encode(mine)
    if coded.numel() >= mine.numel():
        coded = mine.cpu()  # a length equal to the payload's says: sent as it is
    length = torch.tensor([float(coded.numel())], dtype=torch.float64, device=payload.device)
    longest = yield AllReduce(length, op="max")
    send = torch.zeros(HEADER_BYTES + int(host.numbers(longest)[0]), dtype=torch.uint8)
    counted = coded.numel() <= send.numel() - HEADER_BYTES
    send[:HEADER_BYTES] = torch.tensor([coded.numel() if counted else _NOT_SENT], dtype=torch.int32).view(torch.uint8)
    if counted:
        send[HEADER_BYTES : HEADER_BYTES + coded.numel()] = coded
    gathered = yield AllGather(send.to(payload.device))
    out = []
    for frame in gathered:
        received = frame.cpu()
        # a frame equal to this rank's own decodes to its payload: skip that decode
        out.append(mine.clone() if torch.equal(received, send) else _decoded(received, mine.numel()).to(payload.device))
    return out


def _decoded(frame: torch.Tensor, size: int) -> torch.Tensor:
    """One rank's gathered frame back to its ``size`` payload bytes."""
    length = int(frame[:HEADER_BYTES].clone().view(torch.int32)[0])  # frames may start anywhere in one buffer
    if length == _NOT_SENT:
        raise RuntimeError("an entropy-coded frame from a rank whose length was not in the gather's maximum was decoded")
    if not 0 <= length <= frame.numel() - HEADER_BYTES:
        raise RuntimeError(f"entropy-coded frame says {length} bytes but holds {frame.numel() - HEADER_BYTES}")
    body = frame[HEADER_BYTES : HEADER_BYTES + length]
    if length == size:
        return body.clone()
    return huffman_decode(body, size)
