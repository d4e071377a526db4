"""The DDP hook in real 2-rank gloo processes."""

from __future__ import annotations

import pytest
import torch

from commpress.bench.launch import run_local

pytestmark = pytest.mark.multiproc
STEPS = 30


def _train(rank: int, world: int, configs: list) -> list:
    from commpress.workloads.train import train_ddp

    return [train_ddp(c, steps=STEPS, return_params=True, bucket_cap_mb=0.5) for c in configs]


@pytest.fixture(scope="module")
def runs():
    configs = [
        None,  # DDP's own all-reduce
        {"method": "none"},
        # two method groups inside every bucket: gathered copies, scattered back
        {"method": "none", "overrides": [{"params": ["*.bias"], "method": "none"}]},
        {"method": "fp16"},
        {"method": "bf16"},
        {"method": "bf16", "overrides": [{"params": ["*.bias", "embed.*"], "method": "none"}]},
        {"method": "fp16", "start_iter": STEPS},  # never leaves the warm-up
    ]
    return dict(zip(range(len(configs)), zip(*run_local(_train, 2, configs))))


def test_none_is_bit_identical_to_ddp_without_hook(runs):
    ref = runs[0][0].params
    for key in (1, 2, 6):
        for rank_result in runs[key]:
            assert torch.equal(rank_result.params, ref)


@pytest.mark.parametrize(("key", "tol"), [(3, 2e-3), (4, 2e-2), (5, 2e-2)])
def test_half_precision_stays_close(runs, key, tol):
    # 30 SGD steps on values of size ~0.1: rounding of fp16 (2^-11) and bf16 (2^-8) on
    # the wire accumulates to at most a few units of that relative to the weights.
    ref = runs[0][0].params
    a, b = runs[key]
    assert torch.equal(a.params, b.params)  # ranks stay identical
    assert (a.params - ref).abs().max().item() < tol
    assert abs(a.eval_loss - runs[0][0].eval_loss) < 0.01


def test_bytes_per_step(runs):
    n = runs[0][0].params.numel()
    assert runs[1][0].bytes_per_step == 4 * n
    assert runs[3][0].bytes_per_step == 2 * n
    assert runs[6][0].bytes_per_step == 4 * n  # warm-up sends uncompressed
    biases = sum(p.numel() for name, p in _model().named_parameters() if name.endswith("bias") or name.startswith("embed"))
    assert runs[5][0].bytes_per_step == 2 * (n - biases) + 4 * biases


def _model():
    from commpress.workloads.charlm import CharTask

    return CharTask().model()


def _mismatch(rank: int, world: int) -> str:
    from torch.nn.parallel import DistributedDataParallel

    from commpress import ConfigError, register

    ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
    try:
        register(ddp, {"method": "fp16" if rank == 0 else "bf16"})
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_config_mismatch_across_ranks_is_an_error_on_every_rank():
    for message in run_local(_mismatch, 2):
        assert "commpress config differs across ranks" in message


def _state_round_trip(rank: int, world: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    from commpress import CommState, ConfigError, ddp_hook, register

    ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
    state = register(ddp, {"method": "fp16", "start_iter": 2}).hook
    for _ in range(3):
        ddp(torch.ones(2, 4)).sum().backward()
    saved = state.state_dict()
    assert saved["step"] == 3
    other = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    fresh = CommState({"method": "fp16", "start_iter": 2}, model=other.module)
    other.register_comm_hook(fresh, ddp_hook)  # the lower-level, PyTorch-style entry point
    fresh.load_state_dict(saved)
    assert fresh.step == 3
    wrong = CommState({"method": "bf16"})
    try:
        wrong.load_state_dict(saved)
    except ConfigError as exc:
        return [str(exc)]
    return []


def test_state_dict_round_trip_and_config_check():
    for messages in run_local(_state_round_trip, 2):
        assert messages and "Load it with the same config" in messages[0]
        # the message names what differs, not hashes
        assert "method: 'fp16' (saved) vs 'bf16' (now)" in messages[0] and "start_iter: 2 (saved) vs 0 (now)" in messages[0]


def test_state_is_lazy_and_says_what_is_missing_when_used_without_a_process_group():
    """Built before init_process_group (Lightning does this), it connects on first use;
    used with no process group at all, it says what to call."""
    from commpress import CommState

    state = CommState({"method": "powersgd"})
    assert state.step == 0 and state.state_dict()["step"] == 0  # checkpoints work unconnected
    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group\(...\) first"):
        state.connect()
