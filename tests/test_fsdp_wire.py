"""The [fsdp] config table and the FSDP payload format, in-process (no ranks)."""

from __future__ import annotations

import math

import pytest
import torch

from commpress import Config, ConfigError
from commpress.fsdp import FSDPConfig, load_fsdp_config
from commpress.fsdp.fsdp2 import ParamShard, Unit
from commpress.fsdp.wire import Segments, Wire


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"weight_bits": 3}, "fsdp.weight_bits = 3 is not accepted; accepted: 2, 4, 8"),
        ({"grad_bits": 16}, "fsdp.grad_bits = 16 is not accepted; accepted: 2, 4, 8"),
        ({"grad_bits": True}, "fsdp: grad_bits = True is not accepted; expected an integer"),
        ({"bucket_size": 100}, "fsdp.bucket_size = 100 is not accepted; expected a multiple of 8"),
        ({"min_numel": -1}, "fsdp.min_numel = -1 is not accepted"),
        ({"exclude": "*norm*"}, "fsdp: exclude = '*norm*' is not accepted; expected a list of a string"),
        ({"weight_bitz": 8}, "fsdp: unknown key 'weight_bitz'; accepted keys: bucket_size, exclude, grad_bits"),
    ],
)
def test_bad_config_names_key_value_and_accepted(table, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        Config.load({"fsdp": table})


def test_config_forms():
    cfg = Config.load({"method": "none", "fsdp": {"weight_bits": 4, "exclude": ["*norm*"]}})
    section = cfg.section("fsdp")
    assert section == FSDPConfig(weight_bits=4, exclude=("*norm*",))
    assert load_fsdp_config(cfg) == section
    assert load_fsdp_config({"fsdp": {"weight_bits": 4, "exclude": ["*norm*"]}}) == section
    assert load_fsdp_config({"weight_bits": 4, "exclude": ["*norm*"]}) == section  # the table's keys alone
    assert load_fsdp_config({"method": "none"}) == FSDPConfig()  # no table: defaults
    with pytest.raises(ConfigError, match="fsdp: unknown key 'weight_bitz'"):
        load_fsdp_config({"weight_bitz": 8})
    assert cfg.to_dict()["fsdp"]["weight_bits"] == 4


def test_exclusions():
    cfg = FSDPConfig(min_numel=100)
    assert cfg.keeps_full_precision("layers.0.norm.weight", 10_000)
    assert cfg.keeps_full_precision("embed.weight", 10_000)
    assert cfg.keeps_full_precision("body.0.bias", 10_000)
    assert cfg.keeps_full_precision("body.0.weight", 99)  # small
    assert not cfg.keeps_full_precision("body.0.weight", 100)


def test_unit_segments_follow_parameter_layout():
    params = (
        ParamShard("embed.weight", 3072, 1536),
        ParamShard("body.0.weight", 100_000, 50_000),
        ParamShard("body.0.bias", 512, 256),
        ParamShard("body.2.weight", 8192, 4096),
    )
    unit = Unit(0, params, FSDPConfig())
    seg = unit.segments(8)
    assert seg.quantized == ((1536, 50_000), (51_792, 4096))  # weights; embedding and bias raw
    assert seg.raw == ((0, 1536), (51_536, 256))
    assert unit.segments(32).quantized == ()
    assert unit.wire("grads", 55_888, torch.float32) is not None
    assert unit.wire("grads", 1000, torch.float32) is None  # not the unit's full shard: plain collective
    assert Unit(0, params, FSDPConfig(grad_bits=32)).wire("grads", 55_888, torch.float32) is None


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_payload_size_is_bits_per_element_plus_scales(bits):
    seg = Segments(10_000, ((0, 3000), (3100, 6900)))  # 100 raw elements in the middle
    wire = Wire(seg, bits, 512, torch.float32)
    nb = math.ceil(9900 / 512)
    expected = 8 * nb + 4 * 100 + math.ceil(9900 * bits / 8)
    assert wire.nbytes == 4 * math.ceil(expected / 4)


def test_raw_ranges_round_trip_exactly_and_quantized_within_one_step():
    torch.manual_seed(0)
    x = torch.randn(5000)
    seg = Segments(5000, ((0, 2000), (2500, 2500)))
    wire = Wire(seg, 4, 256, torch.float32)
    payload = torch.empty(wire.nbytes, dtype=torch.uint8)
    wire.encode(x, seed=7, payload=payload)
    out = torch.full_like(x, float("nan"))
    wire.decode(payload, out)
    assert torch.equal(out[2000:2500], x[2000:2500])  # raw: bit-exact
    # quantized: each element within one quantization step of its bucket
    q = torch.cat([x[:2000], x[2500:]])
    dq = torch.cat([out[:2000], out[2500:]])
    for b in range(0, q.numel(), 256):
        xs = q[b : b + 256]
        step = (xs.max() - xs.min()) / 15
        assert (dq[b : b + 256] - xs).abs().max() <= step * (1 + 1e-5)
    assert not torch.equal(dq, q)


def test_quantizer_is_unbiased_through_the_payload():
    # K independent encodings (different seeds) of the same x: the per-element error of one
    # decode is bounded by the bucket's step s and has variance <= s^2/4, so the mean of K
    # decodes deviates from x by at most 6 * s / (2 sqrt(K)) except with probability ~2e-9
    # per element (Gaussian tail; Hoeffding gives the same order), ~1e-5 for all 4096.
    # A biased rounding (e.g. always down) is off by ~s/2, far outside that band.
    torch.manual_seed(1)
    n, bits, bucket, k = 4096, 2, 512, 400
    x = torch.randn(n) * torch.linspace(0.1, 3, n)
    wire = Wire(Segments(n, ((0, n),)), bits, bucket, torch.float32)
    payload = torch.empty(wire.nbytes, dtype=torch.uint8)
    mean = torch.zeros(n, dtype=torch.float64)
    out = torch.empty(n)
    for seed in range(k):
        wire.encode(x, seed=seed, payload=payload)
        wire.decode(payload, out)
        mean += out.double() / k
    xb = x.view(-1, bucket)
    step = ((xb.max(1).values - xb.min(1).values) / (2**bits - 1)).repeat_interleave(bucket).double()
    z = (mean - x.double()).abs() / (step / (2 * math.sqrt(k)))
    assert z.max().item() < 6
    assert z.mean().item() < 1.5  # |N(0,1)| has mean 0.8; the variance bound makes z smaller still


def test_accumulate_averages_ranks_in_quantized_ranges_only():
    torch.manual_seed(2)
    world, n = 3, 1000
    seg = Segments(n, ((0, 400), (600, 400)))
    wire = Wire(seg, 8, 128, torch.float32, carry_raw=False)
    assert wire.nbytes == 4 * math.ceil((8 * math.ceil(800 / 128) + 800) / 4)  # no room for raw ranges
    xs = torch.randn(world, n)
    payloads = torch.empty(world, wire.nbytes, dtype=torch.uint8)
    for r in range(world):
        wire.encode(xs[r], seed=r, payload=payloads[r])
    out = torch.full((n,), 5.0)
    wire.accumulate(payloads, out, average=True)
    assert torch.equal(out[400:600], torch.full((200,), 5.0))  # raw ranges untouched
    exact = xs.mean(0)
    step = (xs.max() - xs.min()) / 255
    assert (out[:400] - exact[:400]).abs().max() <= step
    assert (out[600:] - exact[600:]).abs().max() <= step


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_stay_non_finite_in_their_bucket_only(bad):
    # policy: a NaN/inf makes its whole bucket NaN after decoding (never silently finite,
    # so AMP's inf checks still fire); other buckets are untouched. No state to poison.
    torch.manual_seed(3)
    x = torch.randn(1024)
    y = x.clone()
    y[5] = bad
    wire = Wire(Segments(1024, ((0, 1024),)), 8, 256, torch.float32)
    clean, dirty = (torch.empty(wire.nbytes, dtype=torch.uint8) for _ in range(2))
    wire.encode(x, seed=4, payload=clean)
    wire.encode(y, seed=4, payload=dirty)
    out, ref = torch.empty(1024), torch.empty(1024)
    wire.accumulate(torch.stack([clean, dirty]), out, average=True)
    wire.accumulate(torch.stack([clean, clean]), ref, average=True)
    assert out[:256].isnan().all()
    assert torch.equal(out[256:], ref[256:])
