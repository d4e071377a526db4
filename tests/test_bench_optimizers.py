"""The benchmarks' Muon on CPU (commpress.bench.optimizers.Float32Muon): torch.optim.Muon's
update with the Newton-Schulz iteration in float32, so it agrees with torch's (bfloat16)
to bfloat16's precision and orthogonalizes as it does."""

from __future__ import annotations

import torch

from commpress.bench.optimizers import Float32Muon, orthogonalized


def test_float32_muon_steps_as_torchs_muon_to_bfloat16_precision():
    torch.manual_seed(0)
    for shape in ((64, 32), (32, 64)):
        ours, torchs = torch.nn.Parameter(torch.randn(shape)), torch.nn.Parameter(torch.zeros(shape))
        torchs.data.copy_(ours.data)
        a = Float32Muon([ours], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        b = torch.optim.Muon([torchs], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        start = ours.detach().clone()
        for _ in range(3):
            g = torch.randn(shape)
            ours.grad, torchs.grad = g.clone(), g.clone()
            a.step()
            b.step()
        moved = (torchs - start).abs().max().item()
        assert (ours - torchs).abs().max().item() < 0.05 * moved  # bfloat16 keeps 8 bits


def test_the_iteration_brings_every_singular_value_near_one():
    torch.manual_seed(1)
    g = torch.randn(48, 16) @ torch.diag(torch.logspace(-2, 0, 16))  # singular values over 2 decades
    s = torch.linalg.svdvals(orthogonalized(g, (3.4445, -4.775, 2.0315), 5, 1e-7))
    assert s.min() > 0.5 and s.max() < 1.3, s  # the quintic lands in about [0.7, 1.2]
