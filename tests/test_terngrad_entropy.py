"""TernGrad with entropy-coded codes: the same bits as without, fewer bytes, loud on a bad frame."""

from __future__ import annotations

import math

import pytest
import torch
from test_terngrad import _reduce

from commpress import ConfigError
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build
from commpress.compressors.wire.entropy import HEADER_BYTES, coded_gather


def _buckets(world: int, sizes: tuple[int, ...], seed: int = 0, dtype=torch.float32) -> list[Bucket]:
    g = torch.Generator().manual_seed(seed)
    names = [f"t{i}" for i in range(len(sizes))]
    return [Bucket.from_tensors(0, [torch.randn(n, generator=g).to(dtype) for n in sizes], names) for _ in range(world)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_bits_as_the_plain_codes(dtype):
    sizes = (5000, 37, 0, 1, 1200)
    for step in range(3):
        plain, coded = _buckets(3, sizes, seed=step, dtype=dtype), _buckets(3, sizes, seed=step, dtype=dtype)
        coded[1].buffer[7] = math.inf  # a non-finite tensor decodes to NaN either way
        plain[1].buffer[7] = math.inf
        _reduce(plain, step=step)
        sim = _reduce(coded, step=step, entropy=True)
        for p, c in zip(plain, coded, strict=True):
            assert torch.equal(p.buffer.nan_to_num(7.0), c.buffer.nan_to_num(7.0))
        assert coded[0].buffer[:5000].isnan().all() and coded[0].buffer[5000:].isfinite().all()
        assert all(t.collectives == 2 for t in sim.traffic)


def test_fewer_bytes_padded_to_the_largest_rank():
    n = 200_000
    buckets = _buckets(2, (n,))
    plain_bytes = n // 4 + 4  # 2-bit codes and one scale
    sim = _reduce(buckets, entropy=True)
    sent = [t.bytes_sent for t in sim.traffic]
    # Gaussian values clipped at 2.5 sigma: about 32% nonzero, 1.22 bits of entropy a value
    assert sent[0] == sent[1] < 0.65 * plain_bytes
    assert sent[0] > 1.2 * n / 8  # no code beats the entropy: the test sees real coding
    # the gather is padded to the largest coded payload, behind a 4-byte length; 8 bytes of sizes first
    assert (sent[0] - 8 - HEADER_BYTES) <= 0.62 * plain_bytes


def test_a_payload_that_does_not_shrink_travels_as_it_is():
    world = 2
    sim = SimulatedWorld(world)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    payloads = [torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g) for g in gens]
    got = sim.run([coded_gather(p) for p in payloads])
    for rows in got:
        assert all(torch.equal(a, b) for a, b in zip(rows, payloads, strict=True))
    assert all(t.bytes_sent == 8 + HEADER_BYTES + 4096 for t in sim.traffic)


def test_a_frame_that_lies_about_its_length_is_refused():
    gen = coded_gather(torch.zeros(1000, dtype=torch.uint8))
    sizes = next(gen)
    request = gen.send(sizes.tensor)  # a world of one: the largest size is its own
    bad = request.tensor.clone()
    bad[:HEADER_BYTES] = torch.tensor([10_000], dtype=torch.int32).view(torch.uint8)
    # gathered frames as a backend returns them: views of one buffer, at any byte offset
    flat = torch.cat([torch.zeros(1, dtype=torch.uint8), request.tensor, bad])
    width = request.tensor.numel()
    with pytest.raises(RuntimeError, match="says 10000 bytes but holds"):
        gen.send([flat[1 : 1 + width], flat[1 + width :]])


def test_a_rank_outside_the_maximum_sends_a_frame_nobody_decodes():
    """A replica healing under a torchft Manager counts as nothing in the sizes' maximum, so
    its own codes may be longer than the frames: it still sends one (the collective goes on,
    its frame is dropped), saying it holds nothing; decoding it is refused."""
    noisy = torch.randint(0, 256, (4000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    gen = coded_gather(noisy)  # codes to about 4000 bytes
    sizes = next(gen)
    assert sizes.tensor.item() > 1000
    request = gen.send(torch.tensor([10.0], dtype=torch.float64))  # the counted ranks' largest: 10 bytes
    assert request.tensor.numel() == HEADER_BYTES + 10
    outside = request.tensor
    assert outside[:HEADER_BYTES].view(torch.int32).item() == -1
    counted = coded_gather(torch.zeros(8, dtype=torch.uint8))  # a counted rank that gets that frame
    own = counted.send(next(counted).tensor)
    width = max(own.tensor.numel(), outside.numel())
    frames = [torch.cat([f, torch.zeros(width - f.numel(), dtype=torch.uint8)]) for f in (own.tensor, outside)]
    with pytest.raises(RuntimeError, match="not in the gather's maximum"):
        counted.send(frames)


def test_config_errors():
    with pytest.raises(ConfigError, match=r"entropy"):
        build("terngrad", {"entropy": "yes"})
