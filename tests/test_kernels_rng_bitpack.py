"""CPU kernels of commpress.kernels: the counter-based generator and the bit packing format."""

import kernel_oracle
import numpy as np
import pytest
import torch

from commpress.kernels import derive_seed, pack_bits, packed_size, uniform, unpack_bits
from commpress.kernels.cpu._chunks import CHUNK

M64 = (1 << 64) - 1


def ref_draw(seed: int, i: int) -> int:
    """Draw i of the stream, straight from the SplitMix64 definition in Python ints."""
    z = (seed + (i // 2) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return (z >> 32) if i % 2 else (z & 0xFFFFFFFF)


def test_uniform_matches_the_definition_across_blocks_and_offsets():
    seed = derive_seed(1234, 5)
    n = CHUNK + 301  # crosses a block boundary
    u = uniform(seed, n).numpy()
    for i in [0, 1, 2, 3, 1001, CHUNK - 1, CHUNK, CHUNK + 1, n - 1]:
        assert u[i] == np.float32((ref_draw(seed, i) & 0x7FFFFF) * 2.0**-23)
    for offset in (1, 2, 7, CHUNK - 3):  # odd offsets start inside a 64-bit word
        assert np.array_equal(uniform(seed, 100, offset).numpy(), u[offset : offset + 100])


def test_uniform_statistics():
    u = uniform(derive_seed(7), 1 << 20).numpy().astype(np.float64)
    assert u.min() >= 0.0 and u.max() < 1.0
    # mean of 2^20 U(0,1): std 0.2887/1024 = 2.8e-4; 5 sigma bound
    assert abs(u.mean() - 0.5) < 1.5e-3
    # 64 bins of expected 16384 each, std ~127: every bin within 5 sigma
    counts = np.bincount((u * 64).astype(np.int64), minlength=64)
    assert np.all(np.abs(counts - 16384) < 5 * 128)
    # neighbours (same 64-bit word and across words) uncorrelated: corr std 1e-3, 5 sigma
    for lag in (1, 2):
        assert abs(np.corrcoef(u[:-lag], u[lag:])[0, 1]) < 5e-3


def test_seeds_give_different_streams():
    a, b = uniform(derive_seed(0, 0), 1000), uniform(derive_seed(0, 1), 1000)
    assert (a == b).float().mean() < 0.01
    assert torch.equal(uniform(derive_seed(0, 1), 1000), b)


def test_derive_seed_uses_order_and_every_value():
    seeds = {derive_seed(1, 2, 3), derive_seed(3, 2, 1), derive_seed(1, 2), derive_seed(1, 2, 3, 0), derive_seed(1, 2, 4)}
    assert len(seeds) == 5
    assert all(0 <= s <= M64 for s in seeds)
    assert derive_seed(-1) == derive_seed(M64)
    with pytest.raises(TypeError):
        derive_seed(1.5)


def ref_pack(codes: list[int], bits: int) -> list[int]:
    out = [0] * packed_size(len(codes), bits)
    for i, c in enumerate(codes):
        out[i * bits // 8] |= (c & ((1 << bits) - 1)) << (i * bits % 8)
    return out


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_format_and_round_trip(bits):
    gen = torch.Generator().manual_seed(bits)
    for n in [0, 1, 3, 7, 8, 9, 17, 255, CHUNK + 5]:
        codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8, generator=gen)
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == packed_size(n, bits)
        if n < 300:
            assert packed.tolist() == ref_pack(codes.tolist(), bits)
        assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_pack_keeps_only_low_bits():
    codes = torch.tensor([0xFF, 0x05, 0xF2, 0x03, 0x04], dtype=torch.uint8)
    assert pack_bits(codes, 2).tolist() == ref_pack(codes.tolist(), 2)
    assert unpack_bits(pack_bits(codes, 2), 2, 5).tolist() == [3, 1, 2, 3, 0]


def test_pack_errors():
    with pytest.raises(ValueError, match="bits=3"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(TypeError, match="uint8"):
        pack_bits(torch.zeros(4), 2)
    with pytest.raises(ValueError, match="need 3"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 2, 9)


def test_derive_seeds_folds_a_common_prefix_once():
    from commpress.kernels.rng import derive_seeds

    last = [0, 1, 2**32 - 1, -1, 2**70]
    assert derive_seeds((5, 1, 300), last) == [derive_seed(5, 1, 300, v) for v in last]
    assert len(set(derive_seeds((5, 1, 300), [0, 1, 2]))) == 3
    with pytest.raises(TypeError, match="takes ints"):
        derive_seeds((5,), [1.0])


def test_every_splitmix64_agrees_with_the_definition():
    """SplitMix64 is written once per runtime: compiled for the CPU (numba; it also folds the
    keys of derive_seed), in CUDA (``common.cuh``: test_kernels_host.py and test_cuda_kernels.py
    compare its uniforms and sample indices with the CPU's) and in torch integer ops (the
    low-rank methods' shared factors). Each agrees with the definition in Python integers."""
    from commpress.compressors.wire.seeding import mix64 as torch_mix64
    from commpress.kernels.cpu import rng as cpu_rng

    gen = np.random.default_rng(5)
    words = [0, 1, 2**63 - 1, 2**63, M64, 0x0123456789ABCDEF, *(int(w) for w in gen.integers(0, 2**64, 50, dtype=np.uint64))]
    want = [kernel_oracle.mix64(w) for w in words]
    assert [int(cpu_rng.mix(np.uint64(w))) for w in words] == want
    signed = torch.tensor([w - 2**64 if w >= 2**63 else w for w in words], dtype=torch.int64)
    assert [v & M64 for v in torch_mix64(signed).tolist()] == want
    for values in [(), (0,), (1, 2, 3), (-1, 2**70, M64), tuple(words[:12])]:
        assert derive_seed(*values) == kernel_oracle.derive_seed(*values)
    seed = derive_seed(9)
    assert np.array_equal(uniform(seed, 1001, 77).numpy(), kernel_oracle.uniform(seed, 1001, 77).numpy())
    assert all(int(cpu_rng.word(np.uint64(seed), np.uint64(c))) == kernel_oracle.words(seed, c, 1)[0] for c in (0, 5, 2**40))
