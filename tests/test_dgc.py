"""Top-k with DGC (Lin et al., 2018): momentum correction, factor masking and local clipping
against a float64 reference written from the paper's equations; state, resume, the
non-finite policy, and the hand-over of an optimizer's momentum. The same in real DDP
(2 gloo ranks) is in tests/test_dgc_ddp.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_fake_cuda import CUDA, _drive, fake_cuda  # noqa: F401  (fake_cuda: a fixture)

from commpress import ConfigError
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, build
from commpress.compressors.topk import topk_count
from commpress.hooks.optimizer import HANDED_OVER, hand_over_momentum

WORLD = 2
SIZES = {"w": 300, "x": 90, "b": 7}  # with min_numel = 50: w and x sparsified, b sent whole
BASE = {"ratio": 0.05, "dgc": True, "momentum": 0.9, "min_numel": 50, "selection": "exact"}


def _grads(step: int, scale: float = 1.0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [{n: scale * torch.randn(s, generator=g) for n, s in SIZES.items()} for _ in range(WORLD)]


def _reduce(sim: SimulatedWorld, comps, grads, step: int, names=tuple(SIZES)) -> dict[str, torch.Tensor]:
    """One committed step of one bucket per rank; rank 0's averages by name (all ranks agree)."""
    bs = [Bucket.from_tensors(0, [g[n] for n in names], list(names)) for g in grads]
    sim.reduce(comps, bs, step)
    for c in comps:
        c.end_step(True)
    for b in bs[1:]:
        assert torch.equal(b.buffer, bs[0].buffer)
    return {n: v.clone() for n, v in zip(names, bs[0].views())}


class Reference:
    """DGC written from the paper, per rank r and tensor, in float64:

    g_r <- g_r * min(1, (clip / sqrt(N)) / |g_r|)          local gradient clipping
    u_r <- m u_r + g_r;  v_r <- v_r + u_r                   momentum correction
    sent_r = v_r on the top-k |v_r|;  v_r <- 0 there;  u_r <- 0 there (momentum factor masking)
    out = sum_r sent_r / N
    and for a tensor sent whole, exact momentum SGD: U <- m U + sum_r g_r / N;  out = U.
    """

    def __init__(self, ratio: float, momentum: float, masking: bool, clip: float, min_numel: int) -> None:
        self.ratio, self.m, self.masking, self.clip, self.min_numel = ratio, momentum, masking, clip, min_numel
        self.u = [{n: torch.zeros(s, dtype=torch.float64) for n, s in SIZES.items()} for _ in range(WORLD)]
        self.v = [{n: torch.zeros(s, dtype=torch.float64) for n, s in SIZES.items()} for _ in range(WORLD)]
        self.big_u = {n: torch.zeros(s, dtype=torch.float64) for n, s in SIZES.items()}

    def step(self, grads) -> dict[str, torch.Tensor]:
        out = {}
        for name, size in SIZES.items():
            gs = [g[name].double() for g in grads]
            if self.clip:
                gs = [g * min(1.0, (self.clip / math.sqrt(WORLD)) / (float(g.norm()) + 1e-6)) for g in gs]
            if size < self.min_numel:
                self.big_u[name] = self.m * self.big_u[name] + sum(gs) / WORLD
                out[name] = self.big_u[name].clone()
                continue
            total = torch.zeros(size, dtype=torch.float64)
            for r, g in enumerate(gs):
                u, v = self.u[r], self.v[r]
                u[name] = self.m * u[name] + g
                v[name] = v[name] + u[name]
                top = v[name].abs().topk(topk_count(self.ratio, size)).indices
                total[top] += v[name][top]
                v[name][top] = 0
                if self.masking:
                    u[name][top] = 0
            out[name] = total / WORLD
        return out


@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize("clip", [0.0, 3.0])
def test_matches_the_float64_reference_of_the_paper(masking, clip):
    params = {**BASE, "momentum_masking": masking, "clip_norm": clip}
    sim = SimulatedWorld(WORLD)
    comps = sim.compressors(lambda: build("topk", params))
    ref = Reference(0.05, 0.9, masking, clip, 50)
    for step in range(8):
        grads = _grads(step)
        got, want = _reduce(sim, comps, grads, step), ref.step(grads)
        for name in SIZES:
            # the same entries are sent (an entry is either sent exactly or not at all) ...
            assert torch.equal(got[name] != 0, want[name] != 0), (step, name)
            # ... with the reference's values up to float32 rounding of the accumulations
            assert torch.allclose(got[name].double(), want[name], rtol=1e-5, atol=1e-5), (step, name)
    # the state is the reference's: velocity of the sparsified tensors, momenta of all
    for r, c in enumerate(comps):
        state = c.state_dict()
        assert sorted(state) == ["momentum", "velocity"] and sorted(state["velocity"]) == ["w", "x"]
        for name in ("w", "x"):
            assert torch.allclose(state["velocity"][name].double(), ref.v[r][name], atol=1e-5)
            assert torch.allclose(state["momentum"][name].double(), ref.u[r][name], atol=1e-5)
        assert torch.allclose(state["momentum"]["b"].double(), ref.big_u["b"], atol=1e-6)
    if clip:  # the clipping bound was reached (gradient norms ~ sqrt(n) > 3 / sqrt(2))
        assert float(_grads(0)[0]["w"].norm()) > clip


def test_momentum_masking_clears_momentum_where_sent():
    sim = SimulatedWorld(WORLD)
    masked = sim.compressors(lambda: build("topk", {**BASE, "momentum_masking": True}))
    kept = sim.compressors(lambda: build("topk", BASE))
    out = _reduce(sim, masked, _grads(0), 0)
    _reduce(sim, kept, _grads(0), 0)
    sent = out["w"] != 0
    u_masked, u_kept = masked[0].state_dict()["momentum"]["w"], kept[0].state_dict()["momentum"]["w"]
    v_masked = masked[0].state_dict()["velocity"]["w"]
    own = torch.zeros(300, dtype=torch.bool)  # what rank 0 itself sent: its top-k of |g| at step 0
    own[_grads(0)[0]["w"].abs().topk(topk_count(0.05, 300)).indices] = True
    assert own.any() and (sent | ~own).all()
    assert (u_masked[own] == 0).all() and (v_masked[own] == 0).all()
    assert torch.equal(u_masked[~own], u_kept[~own]) and (u_kept[own] != 0).all()


def test_ratio_one_without_masking_is_momentum_sgd():
    # every entry sent every step: the average of the ranks' momenta is the momentum of
    # the averaged gradient, so DGC delivers exactly what SGD with momentum applies
    params = {"ratio": 1.0, "dgc": True, "momentum": 0.9, "min_numel": 0}
    sim = SimulatedWorld(WORLD)
    comps = sim.compressors(lambda: build("topk", params))
    buf = {n: torch.zeros(s, dtype=torch.float64) for n, s in SIZES.items()}
    for step in range(6):
        grads = _grads(step)
        got = _reduce(sim, comps, grads, step)
        for name in SIZES:
            buf[name] = 0.9 * buf[name] + sum(g[name].double() for g in grads) / WORLD
            assert torch.allclose(got[name].double(), buf[name], rtol=1e-5, atol=1e-6)
        assert all(v.abs().max() == 0 for v in comps[0].state_dict()["velocity"].values())


def test_bytes_on_the_wire():
    sim = SimulatedWorld(WORLD)
    comps = sim.compressors(lambda: build("topk", {**BASE, "value_dtype": "float16"}))
    _reduce(sim, comps, _grads(0), 0)
    k = topk_count(0.05, 300) + topk_count(0.05, 90)
    for t in sim.traffic:  # k (int32 index, float16 value) pairs and the whole tensor in float32
        assert t.bytes_sent == k * (2 + 4) + 4 * 7 and t.collectives == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_step_keeps_the_state(bad):
    sim = SimulatedWorld(WORLD)
    comps = sim.compressors(lambda: build("topk", BASE))
    clean = sim.compressors(lambda: build("topk", BASE))
    _reduce(sim, comps, _grads(0), 0)
    _reduce(sim, clean, _grads(0), 0)
    before = copy.deepcopy([c.state_dict() for c in comps])
    grads = _grads(1)
    grads[1]["b" if bad == math.inf else "w"][3] = bad  # in a tensor sent whole, and in a sparsified one
    bs = [Bucket.from_tensors(0, [g[n] for n in SIZES], list(SIZES)) for g in grads]
    sim.reduce(comps, bs, 1)
    for c in comps:
        c.end_step(True)  # even committed: the compressor staged nothing from this step
    assert all(not b.buffer.isfinite().all() for b in bs)
    for c, old in zip(comps, before):
        for key in old:
            for name, t in old[key].items():
                assert torch.equal(c.state_dict()[key][name], t)
    # the next step carries on as if the bad one had not happened
    for step in (2, 3):
        assert all(
            torch.equal(a, b)
            for a, b in zip(_reduce(sim, comps, _grads(step), step).values(), _reduce(sim, clean, _grads(step), step).values())
        )


def test_resume_with_another_bucket_layout_is_bit_identical():
    sim = SimulatedWorld(WORLD)
    straight = sim.compressors(lambda: build("topk", {**BASE, "selection": "sampled", "clip_norm": 5.0}))
    first = sim.compressors(lambda: build("topk", {**BASE, "selection": "sampled", "clip_norm": 5.0}))
    initial, rebuilt = [("w", "x", "b")], [("b", "x"), ("w",)]

    def step(comps, layout, s):
        out = {}
        for index, names in enumerate(layout):
            bs = [Bucket.from_tensors(index, [g[n] for n in names], list(names)) for g in _grads(s)]
            sim.reduce(comps, bs, s)
            out.update({n: v.clone() for n, v in zip(names, bs[0].views())})
        for c in comps:
            c.end_step(True)
        return out

    expected = [step(straight, initial if s == 0 else rebuilt, s) for s in range(6)]
    for s in range(3):
        step(first, initial if s == 0 else rebuilt, s)
    saved = copy.deepcopy([c.state_dict() for c in first])
    resumed = sim.compressors(lambda: build("topk", {**BASE, "selection": "sampled", "clip_norm": 5.0}))
    for c, state in zip(resumed, saved):
        c.load_state_dict(state)
    for s in range(3, 6):  # a new process: DDP's initial layout first, then the rebuilt one
        got = step(resumed, initial if s == 3 else rebuilt, s)
        for name in SIZES:
            assert torch.equal(got[name], expected[s][name]), (s, name)
    with pytest.raises(ValueError, match=r"expects state with keys \['momentum', 'velocity'\]"):
        resumed[0].load_state_dict({"residuals": {}})


def test_config_errors():
    for params, message in [
        ({"momentum": 0.9}, r"momentum = 0.9 is not accepted without dgc = true"),
        ({"momentum_masking": True}, r"momentum_masking = true is not accepted without dgc = true"),
        ({"dgc": True, "momentum": 1.0}, r"momentum = 1.0 is not accepted; expected a number in \[0, 1\)"),
        ({"dgc": True, "momentum": -0.1}, r"momentum = -0.1 is not accepted"),
        ({"clip_norm": -1.0}, r"clip_norm = -1.0 is not accepted; expected a number >= 0"),
        ({"min_numel": -1}, r"min_numel = -1 is not accepted; expected an integer >= 0"),
        ({"dgc": "yes"}, r"dgc = 'yes' is not accepted; expected true or false"),
    ]:
        with pytest.raises(ConfigError, match=message):
            from commpress.config import Config

            Config.load({"method": "topk", "params": params})
    sim = SimulatedWorld(1)
    with pytest.raises(ConfigError, match=r"dgc = true has no momentum: pass optimizer= to commpress.register"):
        sim.reduce([build("topk", {"dgc": True})], [Bucket.from_tensors(0, [torch.ones(10)], ["w"])])


# ---- the hand-over of the optimizer's momentum ----------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def _compressors(model, params=None, override=None):
    """name -> compressor: DGC for every parameter, or ``override`` (a compressor) for biases."""
    dgc = build("topk", {"dgc": True, **(params or {})})
    return lambda name: override if override is not None and name.endswith("bias") else dgc


def test_hand_over_takes_sgd_momentum_and_zeroes_it():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    of = _compressors(model)
    hand_over_momentum(opt, model.named_parameters(), of)
    assert of("0.weight").momentum == 0.9
    assert opt.param_groups[0]["momentum"] == 0 and opt.param_groups[0][HANDED_OVER] == 0.9
    # a resumed run that loads this optimizer state before registering finds the momentum again
    saved = copy.deepcopy(opt.state_dict())
    model2 = _model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(saved)
    of2 = _compressors(model2)
    hand_over_momentum(opt2, model2.named_parameters(), of2)
    assert of2("0.weight").momentum == 0.9 and opt2.param_groups[0]["momentum"] == 0
    # ... and one that loads an optimizer state from before the hand-over after it is stopped
    model3 = _model()
    opt3 = torch.optim.SGD(model3.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(opt3.state_dict())
    hand_over_momentum(opt3, model3.named_parameters(), _compressors(model3))
    opt3.step()  # handed over: the check passes
    opt3.load_state_dict(before)
    with pytest.raises(ConfigError, match=r"handed its momentum to DGC but has momentum = 0.9 again"):
        opt3.step()


def test_hand_over_keeps_a_configured_momentum_with_an_sgd_without_momentum():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    of = _compressors(model, {"momentum": 0.8})
    hand_over_momentum(opt, model.named_parameters(), of)
    assert of("0.weight").momentum == 0.8 and opt.param_groups[0]["momentum"] == 0
    opt.step()  # no hook installed: nothing was handed over


def test_hand_over_with_a_separate_group_for_other_parameters():
    model = _model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.SGD([{"params": weights}, {"params": biases}], lr=0.1, momentum=0.9)
    of = _compressors(model, override=build("none"))
    hand_over_momentum(opt, model.named_parameters(), of)
    assert [g["momentum"] for g in opt.param_groups] == [0, 0.9]  # the biases keep the optimizer's momentum
    assert of("0.weight").momentum == 0.9


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        (None, {}, r"applies momentum itself: pass optimizer= \(the torch.optim.SGD"),
        (torch.optim.Adam, {"lr": 1e-3}, r"optimizer Adam is not accepted .* turn DGC's momentum correction off"),
        (torch.optim.AdamW, {"lr": 1e-3}, r"optimizer AdamW is not accepted"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, r"nesterov = True, dampening = 0 are not accepted"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}, r"dampening = 0.1 are not accepted"),
    ],
)
def test_hand_over_refuses_what_dgc_cannot_take_over(make, kwargs, message):
    model = _model()
    opt = make(model.parameters(), **kwargs) if make is not None else None
    with pytest.raises(ConfigError, match=message):
        hand_over_momentum(opt, model.named_parameters(), _compressors(model))
    if isinstance(opt, torch.optim.SGD):
        assert opt.param_groups[0]["momentum"] == 0.9  # refused before anything changed


def test_hand_over_refuses_mixed_groups_conflicts_and_start_iter():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ConfigError, match=r"param group 0 holds 2 parameters not compressed with DGC next to 2 that are"):
        hand_over_momentum(opt, model.named_parameters(), _compressors(model, override=build("none")))
    assert opt.param_groups[0]["momentum"] == 0.9  # nothing changed
    with pytest.raises(ConfigError, match=r"momentum = 0.5 is configured, the optimizer's is 0.9"):
        hand_over_momentum(opt, model.named_parameters(), _compressors(model, {"momentum": 0.5}))
    with pytest.raises(ConfigError, match=r"start_iter = 3 is not accepted with method 'topk' with DGC's momentum correction"):
        hand_over_momentum(opt, model.named_parameters(), _compressors(model), start_iter=3)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.SGD([{"params": weights}, {"params": biases, "momentum": 0.5}], lr=0.1, momentum=0.9)
    with pytest.raises(ConfigError, match=r"the parameters of its method group have momentum 0.9 and 0.5"):
        hand_over_momentum(opt, model.named_parameters(), _compressors(model))
    plain = build("topk")
    hand_over_momentum(None, model.named_parameters(), lambda name: plain)  # no DGC: nothing needed


def test_dgc_stays_on_the_gradients_device(fake_cuda):  # noqa: F811  (the fixture)
    """Under FakeTensorMode (see tests/test_fake_cuda.py): every buffer of DGC, the tensors
    sent whole and the state restored from a checkpoint live on the CUDA device."""
    params = {**BASE, "momentum_masking": True, "clip_norm": 1.0, "value_dtype": "bfloat16"}

    def buckets():
        return [Bucket.from_tensors(0, [torch.randn(s, device=CUDA) for s in SIZES.values()], list(SIZES)) for _ in range(WORLD)]

    comps = [build("topk", params) for _ in range(WORLD)]
    for step in range(3):
        bs = buckets()
        _drive(comps, bs, step)
        assert all(b.buffer.device == CUDA for b in bs)
        for c in comps:
            c.end_step(True)
    saved = [c.state_dict() for c in comps]
    assert all(t.device.type == "cpu" for s in saved for part in s.values() for t in part.values())
    resumed = [build("topk", params) for _ in range(WORLD)]
    for c, s in zip(resumed, saved):
        c.load_state_dict(s)
    _drive(resumed, buckets(), 3)
    assert fake_cuda["restored"] == WORLD * 5  # u and v of w and x, U of b: once each, onto the device
    assert fake_cuda["launches"]
