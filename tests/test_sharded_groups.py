"""DiLoCo and the cross-group hook between replica groups of an FSDP2-sharded model: 4 gloo
ranks, 2 groups x 2 shards (tests/sharded_workers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from commpress.bench.launch import run_local

pytestmark = pytest.mark.multiproc

sys.path.insert(0, str(Path(__file__).parent))
import sharded_workers  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_local(sharded_workers.run, 4, str(tmp_path_factory.mktemp("dcp")))


def test_every_group_ends_with_the_same_model(ranks):
    first = ranks[0]["diloco"]["straight"]
    for r in ranks:
        assert torch.equal(r["diloco"]["straight"], first)
    # each rank sent its shard's compressed pseudo-gradients only: far below one fp32 copy per sync
    assert 0 < ranks[0]["diloco"]["bytes"] < 4 * ranks[0]["diloco"]["numel"]


def test_resume_from_a_dcp_checkpoint_mid_round_is_exact(ranks):
    for r in ranks:
        assert r["diloco"]["in_flight"] == 1  # saved with a fragment's average in flight
        assert torch.equal(r["diloco"]["resumed"], r["diloco"]["straight"])
        assert "save every rank's state_dict()" in r["diloco"]["full_refused"]
        assert "does not reshard" in r["diloco"]["resharded"] and "in 2 replica groups" in r["diloco"]["resharded"]
        assert r["diloco"]["sqrt_replicas"] == 2**0.5  # the replica groups average, not every rank


def test_period_one_equals_hsdp(ranks):
    for r in ranks:
        runs = r["period_one"]
        hsdp = runs["hsdp"]
        torch.testing.assert_close(runs["local_sgd"]["params"], hsdp["params"], rtol=1e-5, atol=1e-6)
        assert torch.equal(runs["hook_none"]["params"], hsdp["params"])  # FSDP2's own all-reduce, replaced
        assert "groups_hook" in runs["hook_none"]["kind"]
        assert not torch.equal(runs["hook_topk"]["params"], hsdp["params"])  # it did compress
        assert torch.equal(runs["hook_topk"]["params"], ranks[0]["period_one"]["hook_topk"]["params"])
        assert runs["hook_topk"]["losses"][-1] < runs["hook_topk"]["losses"][0]


def test_a_non_finite_shard_stops_every_rank(ranks):
    for r in ranks:
        assert "is not finite" in r["non_finite"]


def test_refusals_name_the_mesh_and_what_to_do(ranks):
    refused = ranks[0]["refusals"]
    assert "expected a 2-D DeviceMesh with mesh_dim_names ('replicate', 'shard')" in refused["one_dim"]
    assert "must be sharded over mesh['shard'] alone" in refused["hsdp_model"]
    assert "[fsdp]" in refused["fsdp_table"] and "mesh=" in refused["fsdp_table"]
