"""ErrorMemory: per-parameter state by name, staged changes, gathering without copies."""

from __future__ import annotations

import pytest
import torch

from commpress.compressors import host
from commpress.compressors.wire.memory import ErrorMemory

CPU = torch.device("cpu")
PIECES = [("a", 0, (2, 3)), ("b", 6, (4,))]


def _staged(values: torch.Tensor) -> ErrorMemory:
    mem = ErrorMemory()
    mem.stage("error", PIECES, values)
    return mem


def test_nothing_stored_gathers_zeros_and_names_everything_missing():
    mem = ErrorMemory()
    out, missing = mem.gather("error", PIECES, 10, CPU)
    assert torch.equal(out, torch.zeros(10)) and missing == ["a", "b"]
    filled, _ = mem.gather("error", PIECES, 10, CPU, fill=lambda: torch.full((10,), 7.0))
    assert torch.equal(filled, torch.full((10,), 7.0))
    assert not mem.staged


def test_staged_changes_wait_for_commit_and_discard_drops_them():
    values = torch.arange(10.0)
    mem = _staged(values)
    assert mem.staged and mem.tensors("error") == {}
    mem.discard()
    assert not mem.staged and mem.gather("error", PIECES, 10, CPU)[1] == ["a", "b"]
    mem = _staged(values)
    mem.commit()
    assert not mem.staged
    saved = mem.tensors("error")
    assert torch.equal(saved["a"], values[:6].view(2, 3)) and torch.equal(saved["b"], values[6:])
    saved["a"].zero_()  # a copy: the memory is untouched
    assert torch.equal(mem.tensors("error")["a"], values[:6].view(2, 3))


def test_gathering_what_a_bucket_staged_copies_nothing():
    values = torch.arange(10.0)
    mem = _staged(values)
    mem.commit()
    out, missing = mem.gather("error", PIECES, 10, CPU)
    assert out is values and missing == [] and mem.holds(values)
    assert not mem.holds(torch.arange(10.0))


def test_another_layout_gathers_by_name():
    mem = _staged(torch.arange(10.0))
    mem.commit()
    moved = [("b", 0, (4,)), ("c", 4, (3,)), ("a", 7, (2, 3))]
    out, missing = mem.gather("error", moved, 13, CPU)
    assert missing == ["c"] and not mem.holds(out)
    assert torch.equal(out, torch.tensor([6.0, 7, 8, 9, 0, 0, 0, 0, 1, 2, 3, 4, 5]))
    # an entry of another shape (a parameter cut differently, a factor of another rank) is missing
    _, missing = mem.gather("error", [("a", 0, (3, 2))], 6, CPU)
    assert missing == ["a"]


def test_a_restored_entry_moves_to_the_device_through_the_host_seam(monkeypatch):
    mem = ErrorMemory()
    mem.load("q", {"w": torch.ones(2, 2, dtype=torch.float16)})
    moved = []

    def to_device(t, device):
        moved.append((t.device.type, device.type))
        return t.to(device)

    monkeypatch.setattr(host, "to_device", to_device)
    meta = torch.device("meta")  # a device other than the CPU, on any machine
    out, missing = mem.gather("q", [("w", 2, (2, 2))], 6, meta)
    assert out.device == meta and out.dtype == torch.float32 and missing == [] and moved == [("cpu", "meta")]
    mem.clear()
    assert mem.tensors("q") == {}


def test_loading_something_else_than_tensors_is_a_clear_error():
    with pytest.raises(ValueError, match=r"saved 'error' state of 'w' must be a tensor, got list"):
        ErrorMemory().load("error", {"w": [1.0]})
