"""Period policies: the QSR pure function, the QSR and Constant policies, the round clock."""

from __future__ import annotations

import itertools

import pytest

from commpress.local_sgd import QSR, Constant, qsr_period
from commpress.local_sgd.rounds import RoundClock


def test_qsr_reference_values():
    assert qsr_period(0.008, alpha=0.0175, h_base=4) == 4  # (0.0175/0.008)^2 = 4.79 -> 4
    assert qsr_period(0.0040005, alpha=0.0175, h_base=4) == 19  # 19.14 -> 19


def test_qsr_never_decreases_while_lr_decays():
    lrs = [0.1 * 0.97**i for i in range(300)]
    hs = [qsr_period(lr, alpha=0.0175, h_base=4) for lr in lrs]
    assert all(b >= a for a, b in itertools.pairwise(hs))
    assert hs[0] == 4 and hs[-1] > 1000  # it does grow: 0.0175 / (0.1 * 0.97^299) squared


def test_qsr_power_and_floor_at_h_base():
    assert qsr_period(0.01, alpha=0.1, h_base=2, power=1) == 10
    assert qsr_period(0.01, alpha=0.1, h_base=2, power=3) == 1000
    assert qsr_period(1.0, alpha=0.1, h_base=7) == 7


@pytest.mark.parametrize(
    ("kwargs", "needle"), [({"lr": 0.0}, "lr = 0.0"), ({"alpha": -1}, "alpha = -1"), ({"h_base": 0}, "h_base = 0")]
)
def test_qsr_bad_arguments(kwargs, needle):
    args = {"lr": 0.01, "alpha": 0.1, "h_base": 2} | kwargs
    with pytest.raises(ValueError, match=needle):
        qsr_period(**args)


def test_qsr_policy_warmup_and_remaining_cap():
    policy = QSR(alpha=0.0175, h_base=4, warmup_steps=10)
    assert policy.next(step=9, lr=0.0040005) == 4  # warm-up: h_base whatever the lr
    assert policy.next(step=10, lr=0.0040005) == 19
    assert policy.next(step=10, lr=0.0040005, remaining=7) == 7  # never past the last step
    assert policy.next(step=10, lr=0.0040005, remaining=100) == 19
    assert policy.next(step=10, lr=0.0, remaining=30) == 30  # lr = 0: one round to the end


def test_constant_policy_and_errors():
    assert Constant(3).next(step=5, lr=1e-9, remaining=1) == 3
    with pytest.raises(ValueError, match="period h = 0"):
        Constant(0)
    with pytest.raises(ValueError, match="warmup_steps = -1"):
        QSR(0.1, 2, warmup_steps=-1)


def test_round_clock_picks_h_from_the_first_step_of_each_round():
    clock = RoundClock(QSR(alpha=0.0175, h_base=4), total_steps=30)
    lrs = [0.008] * 4 + [0.0040005] * 26  # the second round's first step sees the low lr
    ends = []
    for step, lr in enumerate(lrs):
        clock.begin_step(lr)
        if clock.end_step():
            ends.append(step + 1)
            clock.round_done()
    assert clock.periods == [4, 19, 7]  # 4 + 19 = 23, 7 steps remain: capped
    assert ends == [4, 23, 30] and clock.rounds == 3
    restored = RoundClock(QSR(alpha=0.0175, h_base=4), total_steps=30)
    restored.load_state_dict(clock.state_dict())
    assert restored.state_dict() == clock.state_dict()


def test_a_huge_alpha_caps_the_period_instead_of_overflowing():
    import sys

    from commpress.local_sgd.periods import qsr_period

    assert qsr_period(1e-300, 1e300, 4) == sys.maxsize
