"""Small pieces of the torchft integration, without a lighthouse.

The step count a healing replica takes (``commpress.local_sgd.transaction.peer_clock``): its peer's, read when
the peer answered the quorum, plus what its own clock did since its quorum (a delayed sync
heals when it lands), so that it reads what the peer's own clock reads then. And
``managed_ddp``: built with ``find_unused_parameters=True`` (what keeps DDP's buckets), it
keeps PyTorch's one-time notice that no parameter was unused off stderr, and that line only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from commpress.local_sgd.periods import QSR
from commpress.local_sgd.rounds import RoundClock
from commpress.local_sgd.transaction import peer_clock

ROOT = Path(__file__).resolve().parents[1]
NOTICE = "find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters"


def _at_quorum(clock: RoundClock, rounds: int, lr: float = 0.1) -> RoundClock:
    """Steps until round ``rounds`` ends, not yet counted done: where its sync asks for a quorum."""
    while True:
        clock.begin_step(lr)
        clock.end_step()
        if clock.round_ends:
            if clock.rounds == rounds - 1:
                return clock
            clock.round_done()


@pytest.mark.parametrize("delay", [0, 1])
def test_a_healing_replica_takes_the_step_count_its_peer_has_when_the_sync_lands(delay):
    peer = _at_quorum(RoundClock(2), rounds=9)  # the peer at its quorum: step 18
    own = _at_quorum(RoundClock(2), rounds=1)  # a restarted replica at its first quorum: step 2
    at_quorum = own.state_dict()
    sent = peer.state_dict()
    for clock in (peer, own):  # the sync starts; delay steps later it lands
        clock.round_done()
        for _ in range(delay):
            clock.begin_step(0.1)
            clock.end_step()
    taken = peer_clock(at_quorum, own.state_dict(), sent)
    assert taken == peer.state_dict(), (taken, peer.state_dict())
    assert taken["step"] == 18 + delay


def test_healing_in_the_quorums_own_step_takes_the_peers_rounds_as_they_are():
    """QSR (no delay): the peer's rounds, chosen from its own lr, are taken whole."""
    peer = _at_quorum(RoundClock(QSR(alpha=0.2, h_base=2)), rounds=3, lr=0.01)
    own = _at_quorum(RoundClock(QSR(alpha=0.2, h_base=2)), rounds=1, lr=0.1)
    assert peer.periods != own.periods
    assert peer_clock(own.state_dict(), own.state_dict(), peer.state_dict()) == peer.state_dict()


def _stderr_of(script: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_managed_ddp_keeps_pytorchs_unused_parameters_notice_off_stderr_and_nothing_else():
    pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")
    train = "for _ in range(2):\n    model(torch.randn(3, 4)).sum().backward()\n"
    plain = (
        "import torch\nfrom torch.nn.parallel import DistributedDataParallel\n"
        "from torchft.process_group import ProcessGroupDummy\n"
        "model = DistributedDataParallel(torch.nn.Linear(4, 2), process_group=ProcessGroupDummy(0, 1), "
        "find_unused_parameters=True)\n" + train
    )
    assert NOTICE in _stderr_of(plain)  # PyTorch's notice, as a DDP built so prints it
    managed = (  # and managed_ddp draws nothing from torch's random stream
        "import sys, torch\nfrom commpress.hooks import managed_ddp\n"
        "torch.manual_seed(0)\ntorch.nn.Linear(4, 2)\nexpected = torch.rand(3)\n"
        "print('before', file=sys.stderr, flush=True)\n"
        "torch.manual_seed(0)\nmodel = managed_ddp(torch.nn.Linear(4, 2))\nassert torch.equal(torch.rand(3), expected)\n"
        + train
        + "print('after', file=sys.stderr, flush=True)\n"
    )
    err = _stderr_of(managed)
    assert NOTICE not in err, err
    assert err.index("before") < err.index("after"), err
