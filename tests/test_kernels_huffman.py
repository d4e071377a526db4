"""The Huffman coder of the wire: lossless on any bytes, near the entropy, loud on a bad frame."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from commpress.kernels import huffman_decode, huffman_encode, ternary_quantize_pack
from commpress.kernels.huffman import CHUNK


def _ternary_codes(n: int, seed: int) -> torch.Tensor:
    """TernGrad's codes of a Gaussian tensor clipped at 2.5 sigma (about a third nonzero)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    bound = (2.5 * x.square().mean().sqrt()).reshape(1)
    return ternary_quantize_pack(x, bound.reshape(()), seed, bound=bound)


def _skewed(n: int) -> torch.Tensor:
    """Bytes whose frequencies halve from one value to the next: Huffman's own code for
    them is longer than the coder's limit, so the lengths must be cut."""
    counts = [max(1, n >> (k + 1)) for k in range(24)]
    values = np.repeat(np.arange(24, dtype=np.uint8), counts)[:n]
    return torch.from_numpy(np.random.default_rng(0).permutation(values))


PAYLOADS = {
    "empty": lambda: torch.zeros(0, dtype=torch.uint8),
    "one byte": lambda: torch.tensor([7], dtype=torch.uint8),
    "one value": lambda: torch.full((1000,), 200, dtype=torch.uint8),
    "every value": lambda: torch.arange(256, dtype=torch.uint8).repeat(3),
    "random": lambda: torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)),
    "ternary, chunks and a tail": lambda: _ternary_codes(4 * (2 * CHUNK + 5), 3),
    "skewed": lambda: _skewed(CHUNK + 999),
    "chunks of other statistics": lambda: torch.cat([torch.zeros(CHUNK, dtype=torch.uint8), _ternary_codes(4 * CHUNK, 4)]),
}


@pytest.mark.parametrize("name", PAYLOADS)
def test_decoding_gives_back_the_payload(name):
    payload = PAYLOADS[name]()
    frame = huffman_encode(payload)
    assert frame.dtype == torch.uint8 and frame.dim() == 1
    assert torch.equal(huffman_decode(frame, payload.numel()), payload)


def test_the_longest_code_is_cut_to_the_table():
    """The skewed payload's own Huffman code reaches 23 bits; the coder's stays decodable
    in its 11-bit table and still codes below 2 bits a byte (its entropy is about 2)."""
    payload = _skewed(CHUNK)
    frame = huffman_encode(payload)
    nibbles = frame[8:136].numpy()
    assert np.concatenate([nibbles & 15, nibbles >> 4]).max() == 11
    assert frame.numel() < payload.numel() * 2.05 / 8 + 140


def _optimal_cost(counts: np.ndarray, limit: int) -> int:
    """Bits of the best prefix code of at most ``limit`` bits a symbol (package-merge)."""
    leaves = sorted((int(c), (s,)) for s, c in enumerate(counts) if c)
    items = list(leaves)
    for _ in range(limit - 1):
        packages = [(items[i][0] + items[i + 1][0], items[i][1] + items[i + 1][1]) for i in range(0, len(items) - 1, 2)]
        items = sorted(leaves + packages, key=lambda item: item[0])
    lengths = np.zeros(256, np.int64)
    for _, symbols in items[: 2 * len(leaves) - 2]:
        for s in symbols:
            lengths[s] += 1
    return int((lengths * counts).sum())


@pytest.mark.parametrize("ratio", [0.5, 0.6, 0.75])
def test_a_cut_code_stays_near_the_best_of_its_length(ratio):
    """Geometric frequencies over 200 values: Huffman's own code is longer than 11 bits,
    the cut one is complete (Kraft's sum exactly 1) and within 6% of the best 11-bit code."""
    counts = np.zeros(256, np.int64)
    counts[:200] = np.maximum(1, (ratio ** np.arange(200) * 100_000 * (1 - ratio)).astype(np.int64))  # one chunk
    payload = torch.from_numpy(np.repeat(np.arange(256, dtype=np.uint8), counts))
    frame = huffman_encode(payload)
    nibbles = frame[8:136].numpy()
    lengths = np.empty(256, np.int64)
    lengths[0::2], lengths[1::2] = nibbles & 15, nibbles >> 4
    assert lengths.max() == 11 and ((2048 >> lengths[lengths > 0]).sum()) == 2048
    assert (lengths * counts).sum() <= 1.06 * _optimal_cost(counts, 11)
    assert torch.equal(huffman_decode(frame, payload.numel()), payload)


def test_ternary_codes_cost_little_above_their_entropy():
    payload = _ternary_codes(4 * 600_000, 5)
    counts = np.bincount(payload.numpy(), minlength=256)
    p = counts[counts > 0] / payload.numel()
    entropy_bytes = payload.numel() * float(-(p * np.log2(p)).sum()) / 8
    frame = huffman_encode(payload)
    assert frame.numel() <= 1.02 * entropy_bytes + 8 + 132 * math.ceil(payload.numel() / CHUNK)
    deflated = zlib.compress(payload.numpy().tobytes(), 1)
    assert frame.numel() <= 1.01 * len(deflated)  # as small as deflate's, within 1%


def test_the_frame_does_not_depend_on_the_threads():
    payload = _ternary_codes(4 * 3 * CHUNK, 6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = huffman_encode(payload)
        torch.set_num_threads(2)
        two = huffman_encode(payload)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def _frame_with(frame: torch.Tensor, at: int, value: int) -> torch.Tensor:
    bad = frame.clone()
    bad[at] = value
    return bad


def _byte_left_over(frame: torch.Tensor) -> torch.Tensor:
    """The frame of one chunk with a byte after its body, counted in the body's size."""
    bad = torch.cat([frame, torch.zeros(1, dtype=torch.uint8)])
    bad[136:140] = torch.tensor([int(frame[136:140].view(torch.int32)) + 1], dtype=torch.int32).view(torch.uint8)
    return bad


@pytest.mark.parametrize(
    ("change", "error"),
    [
        pytest.param(lambda f, n: (f[:-1], n), "do not fill", id="a byte short"),
        pytest.param(lambda f, n: (torch.cat([f, torch.zeros(1, dtype=torch.uint8)]), n), "do not fill", id="a byte over"),
        pytest.param(lambda f, n: (f[:100], n), "header bytes", id="no whole header"),
        pytest.param(lambda f, n: (f, n + 1), "was to decode", id="another size"),
        pytest.param(lambda f, n: (_byte_left_over(f), n), "does not decode", id="a byte left in a body"),
        pytest.param(lambda f, n: (_frame_with(f, -1, int(f[-1]) | 0x80), n), "does not decode", id="padding bits set"),
        pytest.param(lambda f, n: (_frame_with(f, 8, 0xCC), n), "not a prefix code", id="a code longer than the table"),
        pytest.param(lambda f, n: (_frame_with(_frame_with(f, 8, 0x11), 9, 0x11), n), "not a prefix", id="not a prefix code"),
        pytest.param(lambda f, n: (_frame_with(f, 136, 0xFF), n), "do not fill", id="a body size that does not fit"),
    ],
)
def test_a_bad_frame_is_refused(change, error):
    payload = _ternary_codes(40_000, 7)
    frame, size = change(huffman_encode(payload), payload.numel())
    with pytest.raises(RuntimeError, match=error):
        huffman_decode(frame, size)


def test_damaged_bodies_never_read_past_the_frame():
    """Flipped bits in a body decode to an error or to other bytes of the right size (the
    code has no checksum: the transport is checked), never past the frame's bytes."""
    payload = _ternary_codes(40_000, 8)
    frame = huffman_encode(payload)
    rng = np.random.default_rng(0)
    refused = 0
    for at in rng.integers(140, frame.numel(), 200):
        bad = _frame_with(frame, int(at), int(frame[int(at)]) ^ (1 << int(rng.integers(8))))
        try:
            assert huffman_decode(bad, payload.numel()).numel() == payload.numel()
        except RuntimeError:
            refused += 1
    assert refused > 0


def test_damaged_frames_stay_inside_their_arrays_with_bounds_checked(tmp_path):
    """The same damaged frames, the kernels compiled with numba's bounds checks (a fresh
    cache): no index leaves its array (an IndexError would end the run)."""
    script = """
import numpy as np, torch
from commpress.kernels import huffman_decode, huffman_encode
rng = np.random.default_rng(0)
payload = torch.from_numpy(rng.geometric(0.4, 300_000).clip(1, 255).astype(np.uint8))
frame = huffman_encode(payload)
assert torch.equal(huffman_decode(frame, payload.numel()), payload)
refused = 0
for at in rng.integers(0, frame.numel(), 300):
    bad = frame.clone()
    bad[int(at)] ^= 1 << int(rng.integers(8))
    try:
        assert huffman_decode(bad, payload.numel()).numel() == payload.numel()
    except RuntimeError:
        refused += 1
print("refused", refused)
"""
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 0


def test_not_bytes_is_refused():
    with pytest.raises(TypeError, match="payload"):
        huffman_encode(torch.zeros(4, dtype=torch.int32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_payload_is_coded_on_the_host_as_the_cpu_one():
    payload = _ternary_codes(4 * CHUNK + 12, 9)
    frame = huffman_encode(payload.cuda())
    assert frame.device.type == "cpu" and torch.equal(frame, huffman_encode(payload))
    assert torch.equal(huffman_decode(frame.cuda(), payload.numel()), payload)
