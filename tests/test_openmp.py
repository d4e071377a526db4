"""How torch's OpenMP workers wait: the ranks commpress starts get a short spin unless the user chose."""

import os

import pytest

from commpress.bench.launch import run_local
from commpress.kernels.cpu.openmp import RANK_SPIN_COUNT, rank_env, wait_setting

_NAMES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def test_rank_env_sets_a_short_spin_unless_the_user_chose():
    assert rank_env({}) == {"GOMP_SPINCOUNT": RANK_SPIN_COUNT} and int(RANK_SPIN_COUNT) < 300_000  # libgomp's default
    assert rank_env({"GOMP_SPINCOUNT": ""}) == {"GOMP_SPINCOUNT": RANK_SPIN_COUNT}  # set but empty: libgomp's default
    assert rank_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert rank_env({"GOMP_SPINCOUNT": "300000"}) == {}


def test_wait_setting_names_what_is_in_effect():
    assert wait_setting({}).startswith("default (workers spin")
    assert wait_setting({"OMP_WAIT_POLICY": "PASSIVE"}) == "OMP_WAIT_POLICY=PASSIVE"
    both = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    assert wait_setting(both) == "GOMP_SPINCOUNT=0, OMP_WAIT_POLICY=PASSIVE"


def _wait_env(rank, world):
    return {name: os.environ.get(name) for name in _NAMES}


@pytest.mark.parametrize(
    "chosen, seen",
    [({}, {"GOMP_SPINCOUNT": RANK_SPIN_COUNT, "OMP_WAIT_POLICY": None}), ({"OMP_WAIT_POLICY": "PASSIVE"}, None)],
)
def test_run_local_ranks_start_with_it_and_ours_is_left_alone(monkeypatch, chosen, seen):
    for name in _NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in chosen.items():
        monkeypatch.setenv(name, value)
    before = {name: os.environ.get(name) for name in _NAMES}
    (got,) = run_local(_wait_env, 1)
    assert got == (seen if seen is not None else before)  # a user's choice passes through unchanged
    assert {name: os.environ.get(name) for name in _NAMES} == before
