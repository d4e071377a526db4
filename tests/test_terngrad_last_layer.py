"""TernGrad's ``skip_last_layer``: the hook state's method groups send the model's last
layer averaged exactly (as ``none``), every other tensor ternary; bytes counted."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from commpress import CommState, ConfigError
from commpress.comm import SimulatedWorld
from commpress.compressors.terngrad import TernGradCompressor
from commpress.config import Config
from commpress.config.groups import LAST_LAYER, MAIN, MethodGroups, last_layer_names

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.ReLU(), nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 5))


def _grads(model: nn.Module) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(WORLD)]


def _hook_average(config: dict, grads: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], int]:
    """Every rank's gradients in one bucket through its CommState (the DDP hook's path),
    on a simulated world: rank 0's average, per tensor, and the bytes rank 0 sent."""
    sim = SimulatedWorld(WORLD)
    models = [_model() for _ in range(WORLD)]
    states = [CommState(config, model=m, backend=b) for m, b in zip(models, sim.backends)]
    buffers = [torch.cat([t.reshape(-1) for t in ts]) for ts in grads]
    futures = [s.reduce(0, buf, list(m.parameters())) for s, buf, m in zip(states, buffers, models)]
    averaged = [f.wait() for f in futures]
    assert torch.equal(averaged[0], averaged[1])
    pieces = averaged[0].split([t.numel() for t in grads[0]])
    return [piece.view(t.shape) for piece, t in zip(pieces, grads[0])], sim.traffic[0].bytes_sent


def _is_ternary(avg: torch.Tensor) -> bool:
    """An average of 2 ranks' ternary codes c_r in {-1, 0, 1} with their scales s_r is
    (c_0 s_0 + c_1 s_1) / 2: magnitudes 0, s_0/2, s_1/2, |s_0 - s_1|/2, (s_0 + s_1)/2."""
    return len(torch.unique(avg.abs())) <= 5


def test_last_layer_is_averaged_exactly_the_rest_ternary():
    model, grads = _model(), _grads(_model())
    names = [n for n, _ in model.named_parameters()]
    exact, full_bytes = _hook_average({"method": "none"}, grads)
    skipped, skipped_bytes = _hook_average({"method": "terngrad", "params": {"skip_last_layer": True}}, grads)
    ternary, ternary_bytes = _hook_average({"method": "terngrad"}, grads)
    last = {"4.weight", "4.bias"}
    assert set(last_layer_names(model)) == last
    for name, e, s, t, g0, g1 in zip(names, exact, skipped, ternary, *grads):
        assert _is_ternary(t) and not torch.equal(t, e), name  # option off: every tensor ternary
        if name in last:
            assert torch.equal(s, e), name  # the none method's average, bit for bit
            torch.testing.assert_close(s, (g0 + g1) / 2)
        else:
            assert _is_ternary(s) and not torch.equal(s, e), name
    # wire bytes: ternary tensors ceil(n/4) + 4 each, the last layer 4 bytes per element
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    assert full_bytes == 4 * sum(sizes.values())
    assert ternary_bytes == sum((n + 3) // 4 + 4 for n in sizes.values())
    assert skipped_bytes == sum((n + 3) // 4 + 4 for k, n in sizes.items() if k not in last) + 4 * (sizes["4.weight"] + 5)


def test_groups_route_the_last_layer_and_overrides_come_first():
    model = _model()
    groups = MethodGroups(Config.load({"method": "terngrad", "params": {"skip_last_layer": True}}), model)
    assert [groups.key_for(n) for n, _ in model.named_parameters()] == [MAIN] * 4 + [LAST_LAYER] * 2
    assert groups.compressors[LAST_LAYER].name == "none" and groups.rounds == 2
    # an override that claims the head keeps it; an override with the option routes its own last layer
    cfg = {"method": "terngrad", "params": {"skip_last_layer": True}, "overrides": [{"params": ["4.bias"], "method": "fp16"}]}
    groups = MethodGroups(Config.load(cfg), model)
    assert groups.key_for("4.bias") == "override0" and groups.key_for("4.weight") == LAST_LAYER
    cfg = {"method": "fp16", "overrides": [{"params": ["4.*"], "method": "terngrad", "method_params": {"skip_last_layer": True}}]}
    groups = MethodGroups(Config.load(cfg), model)
    assert [groups.key_for(n) for n, _ in model.named_parameters()] == [MAIN] * 4 + [LAST_LAYER] * 2
    # off: no extra group
    groups = MethodGroups(Config.load({"method": "terngrad"}), model)
    assert groups.key_for("4.weight") == MAIN and LAST_LAYER not in groups.compressors


def test_last_layer_is_the_last_module_with_parameters_of_its_own():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.norm = nn.LayerNorm(8)
            self.head = nn.Linear(8, 10)
            self.head.weight = self.embed.weight  # tied: named_parameters() lists it as embed.weight
            self.act = nn.ReLU()  # no parameters: not a layer here

    assert last_layer_names(Tied()) == ["embed.weight", "head.bias"]
    assert last_layer_names(nn.ReLU()) == []


@pytest.mark.parametrize("value", [1, "true", None, [True]])
def test_a_value_that_is_not_a_boolean_is_refused(value):
    message = re.escape(f"method 'terngrad': skip_last_layer = {value!r} is not accepted; expected true or false")
    with pytest.raises(ConfigError, match=message):
        Config.load({"method": "terngrad", "params": {"skip_last_layer": value}})
    with pytest.raises(ConfigError, match=message):
        TernGradCompressor(skip_last_layer=value)


def test_the_option_needs_the_model(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('method = "terngrad"\n[params]\nskip_last_layer = true\n')
    assert Config.load(path).params == {"skip_last_layer": True}
    with pytest.raises(ConfigError, match="method 'terngrad': skip_last_layer = true needs the model"):
        CommState(path, backend=SimulatedWorld(1).backends[0])
