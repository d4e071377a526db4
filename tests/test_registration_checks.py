"""What the DDP hooks cannot reduce is refused at registration, by name, not at the first
backward: sparse gradients, parameter dtypes the method does not take, and overrides that
match no parameter."""

from __future__ import annotations

import pytest
import torch

from commpress import CommState, ConfigError


def test_float64_parameters_are_refused_by_count_with_advice_that_works():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2).double())
    with pytest.raises(ConfigError) as err:
        CommState({"method": "powersgd"}, model=model)
    assert str(err.value) == (
        "2 parameters of dtype float64 ('1.weight', '1.bias'): method 'powersgd' does not take float64 (accepted: "
        "float32, float16, bfloat16); convert them, or send them with none / bf16 / fp16 through an override: "
        '[[overrides]] params = ["1.weight", "1.bias"], method = "none"'
    )
    advised = {"method": "powersgd", "overrides": [{"params": ["1.weight", "1.bias"], "method": "none"}]}
    assert set(CommState(advised, model=model).compressors) == {"main", "override0"}


@pytest.mark.parametrize("method", ["none", "fp16", "bf16"])
def test_float64_models_register_with_the_all_reduce_methods(method):
    CommState({"method": method}, model=torch.nn.Linear(3, 3).double())


def test_a_complex_parameter_is_refused():
    model = torch.nn.Linear(3, 3)
    model.register_parameter("phase", torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64)))
    with pytest.raises(ConfigError, match=r"1 parameter of dtype complex64 \('phase'\): no method takes complex64"):
        CommState({"method": "none"}, model=model)


def test_sparse_embeddings_are_refused():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"module '0' \(Embedding\) has sparse=True"):
        CommState({"method": "fp16"}, model=model)


def test_an_override_that_matches_nothing_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    config = {"method": "fp16", "overrides": [{"params": ["*.bias", "*norm*"], "method": "none"}]}
    with pytest.raises(ConfigError, match=r"\['\*norm\*'\] match no parameter"):
        CommState(config, model=model)


def test_supported_models_register_unconnected():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    state = CommState({"method": "bf16", "overrides": [{"params": ["1.*"], "method": "none"}]}, model=model)
    assert set(state.compressors) == {"main", "override0"}


def test_fsdp1_hook_states_are_lazy_too():
    """Like CommState, PyTorch-style FSDP1 hook states can be built before
    init_process_group; they take the group when the first hook runs."""
    from commpress.fsdp import FSDPConfig, LowPrecisionState, QuantizedState

    quantized, low = QuantizedState(FSDPConfig()), LowPrecisionState(torch.bfloat16)
    assert quantized.state_dict()["steps"] == 0 and quantized.state_dict()["rank"] is None and low.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=r"QuantizedState\) needs torch.distributed initialized"):
        quantized.connect()
