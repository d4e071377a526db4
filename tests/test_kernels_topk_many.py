"""The batched Top-k selection is the per-tensor selection applied span by span, bit for bit,
on one and two threads (one thread: every tensor in the compiled batch; two: the largest
tensor takes the per-tensor call that splits it over the threads), and the oracle's."""

import kernel_oracle
import pytest
import torch
from test_kernels_oracle import same_bits

import commpress.kernels as cc
from commpress.kernels.cpu._chunks import CHUNK

# (offset, numel, k): a gap, one-element and empty tensors, k = n, a tensor of several
# blocks (sampled threshold), small ones (exact), one over half the buffer
SPANS = [(0, 5, 2), (7, 1, 1), (8, 0, 0), (8, 300, 3), (308, 3 * CHUNK + 7, 2000), (308 + 3 * CHUNK + 7, 768, 768)]
BIG = (SPANS[-1][0] + 768 + 5, 5 * CHUNK, 600)
NUMEL = BIG[0] + BIG[1] + 3


def buffer(seed: int) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
    x[2], x[9], x[10] = float("nan"), float("-inf"), -0.0
    x[400:700] = 2.5  # a run of ties across the threshold
    x[BIG[0] : BIG[0] + 1000] = 0.0
    return x


def per_tensor(x, spans, seeds, exact):
    values, indices = [], []
    for (o, n, k), seed, e in zip(spans, seeds, exact):
        v, i = cc.topk_select(x.narrow(0, o, n), k, exact=e, seed=seed)
        values.append(v)
        indices.append(i + o)
    return torch.cat(values), torch.cat(indices)


@pytest.mark.parametrize("exact", [False, True])
def test_many_is_the_per_tensor_selection(threads, exact):
    spans = [*SPANS, BIG]
    seeds = [3, 2**64 - 1, 0, 5, 6, 7, 8]
    flags = [exact or n <= 768 for _, n, _ in spans]
    for seed in range(3):
        x, expect = buffer(seed), buffer(seed)
        values, indices = cc.topk_select_many(x, [(o, n) for o, n, _ in spans], [k for *_, k in spans], seeds, flags)
        want_values, want_indices = per_tensor(expect, spans, seeds, flags)
        assert torch.equal(indices, want_indices)
        assert same_bits(values, want_values) and same_bits(x, expect)  # the picks zeroed alike
        assert indices.dtype == torch.int32 and indices.numel() == sum(k for *_, k in spans)
        assert bool(torch.isnan(values).any()) and bool((values == float("-inf")).any())  # NaN and inf rank first
        oracle = buffer(seed)
        picks = kernel_oracle.topk_select_many(oracle, [(o, n) for o, n, _ in spans], [k for *_, k in spans], seeds, flags)
        assert same_bits(picks, (values, indices))
        assert same_bits(oracle, x)


@pytest.mark.parametrize("slack", [None, 0.05])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_many_with_error_feedback_is_add_then_select(threads, grad_dtype, slack, monkeypatch):
    """``grad`` and ``error`` given: each span first becomes add_error(grad, error) (fused into the
    selection's pass on the compiled path), the rest of acc stays as it was. A slack of 0.05 aims
    the sampled threshold at too few candidates, so the threshold must widen after the fused pass."""
    if slack is not None:
        monkeypatch.setattr("commpress.kernels.topk._SLACK", slack)
    spans = [*SPANS, BIG]
    seeds = [3, 2**64 - 1, 0, 5, 6, 7, 8]
    flags = [n <= 768 for _, n, _ in spans]
    grad = buffer(1).to(grad_dtype)
    error = torch.randn(NUMEL, generator=torch.Generator().manual_seed(9))
    error[11] = float("inf")
    acc = torch.full((NUMEL,), 5.0)
    values, indices = cc.topk_select_many(acc, [(o, n) for o, n, _ in spans], [k for *_, k in spans], seeds, flags, grad, error)
    expect = torch.full((NUMEL,), 5.0)
    for o, n, _ in spans:
        cc.add_error(grad.narrow(0, o, n), error.narrow(0, o, n), out=expect.narrow(0, o, n))
    want_values, want_indices = per_tensor(expect, spans, seeds, flags)
    assert torch.equal(indices, want_indices)
    assert same_bits(values, want_values) and same_bits(acc, expect)
    assert float(acc[SPANS[-1][0] + 768]) == 5.0  # a gap between spans: untouched


def test_many_picks_the_largest_magnitudes(threads):
    """Against torch.topk on tie-free data: the same set per tensor, in increasing index order."""
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(4))
    spans = [(o, n, k) for o, n, k in [*SPANS, BIG] if n]
    ref = x.clone()
    count = len(spans)
    _, indices = cc.topk_select_many(x, [(o, n) for o, n, _ in spans], [k for *_, k in spans], [1] * count, [False] * count)
    start = 0
    for o, n, k in spans:
        got = indices[start : start + k].long() - o
        want = torch.topk(ref[o : o + n].abs(), k).indices.sort().values
        assert torch.equal(got, want)
        start += k
    assert float(x[indices.long()].abs().sum()) == 0.0


def test_many_argument_errors():
    x = torch.randn(100)
    with pytest.raises(ValueError, match=r"span \(90, 20\) with k=1 does not fit the 100 elements"):
        cc.topk_select_many(x, [(90, 20)], [1], [0], [False])
    with pytest.raises(ValueError, match=r"span \(0, 10\) with k=11 does not fit"):
        cc.topk_select_many(x, [(0, 10)], [11], [0], [False])
    with pytest.raises(ValueError, match="differ in length: 1, 2, 1, 1"):
        cc.topk_select_many(x, [(0, 10)], [1, 2], [0], [False])
    with pytest.raises(ValueError, match="flat contiguous"):
        cc.topk_select_many(x.view(10, 10), [(0, 10)], [1], [0], [False])
    with pytest.raises(ValueError, match="grad and error come together"):
        cc.topk_select_many(x, [(0, 10)], [1], [0], [False], grad=x.clone())
    with pytest.raises(ValueError, match="of acc's 100 elements"):
        cc.topk_select_many(x, [(0, 10)], [1], [0], [False], grad=torch.ones(50), error=torch.ones(50))
