"""Lightning checkpoints keep the hook state: a run resumed from a checkpoint ends bit for bit
where the uninterrupted run does.

The callback is docs/integrations.md's ``Commpress`` (read from the doc's
``train_lightning.py`` block, so the doc is what is tested). One Lightning launch on 2 CPU
ranks (gloo; Lightning starts the second process by running the script again) trains, with
Top-k (stateful: per-rank error feedback, and each rank its own batches):

* ``straight``: 8 steps without a break;
* ``first``: 4 steps, ``ModelCheckpoint`` saving at step 4 (the end of the first epoch);
* ``resumed``: a new Trainer, ``fit(..., ckpt_path=)`` from that file to step 8;
* ``no_restore``: the same resume with a callback that drops the checkpoint's hook state
  (the control: the comparison can fail).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiproc

DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"

DRIVER = textwrap.dedent(
    '''
    import sys
    from pathlib import Path

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from train_lightning import Commpress, Regression

    CONFIG = {"method": "topk", "params": {"ratio": 0.1, "min_numel": 0}}
    OUT = Path(sys.argv[1])


    class Recorded(Commpress):
        """The doc's callback, noting the order in which Lightning calls it."""

        def __init__(self, config):
            super().__init__(config)
            self.events = []

        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            self.events.append("on_load_checkpoint")
            super().on_load_checkpoint(trainer, pl_module, checkpoint)

        def on_fit_start(self, trainer, pl_module):
            self.events.append("on_fit_start")
            super().on_fit_start(trainer, pl_module)


    class NoRestore(Recorded):
        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            self.events.append("on_load_checkpoint")  # the checkpoint's hook state is dropped


    def loader():
        # 2 ranks x 4 batches of 16: one epoch is 4 steps, so the checkpoint at step 4 ends an
        # epoch; Lightning's DistributedSampler gives each rank its own samples
        x = torch.randn(128, 32, generator=torch.Generator().manual_seed(1))
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)


    def fit(name, max_steps, hook, callbacks=(), ckpt_path=None):
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=DDPStrategy(process_group_backend="gloo"),
            callbacks=[hook, *callbacks],
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=bool(callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=OUT,
        )
        model = Regression()
        trainer.fit(model, loader(), ckpt_path=ckpt_path)
        report = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "events": hook.events,
            "step": hook.state.hook.step,  # the DDP hook's CommState
            "sent": hook.state.traffic.bytes_sent,
        }
        torch.save(report, OUT / f"{name}_rank{trainer.global_rank}.pt")


    if __name__ == "__main__":
        fit("straight", 8, Recorded(CONFIG))
        saver = ModelCheckpoint(dirpath=OUT / "ckpt", filename="{step}", every_n_train_steps=4, save_top_k=-1)
        fit("first", 4, Recorded(CONFIG), [saver])
        (path,) = sorted((OUT / "ckpt").glob("*.ckpt"))
        fit("resumed", 8, Recorded(CONFIG), ckpt_path=path)
        fit("no_restore", 8, NoRestore(CONFIG), ckpt_path=path)
    '''
)


def _doc_block(name: str) -> str:
    for source in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S):
        if source.startswith(f"# {name}:"):
            return source
    raise AssertionError(f"docs/integrations.md has no python block {name}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lightning_ckpt")
    (out / "train_lightning.py").write_text(_doc_block("train_lightning.py"))
    (out / "driver.py").write_text(DRIVER)
    env = dict(os.environ)
    env.pop("MASTER_PORT", None)  # Lightning picks a free port
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 ranks on a small machine: no oversubscribed torch threads
    proc = subprocess.run([sys.executable, "driver.py", str(out)], cwd=out, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"the Lightning runs exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return out


def _report(out: Path, name: str, rank: int) -> dict:
    return torch.load(out / f"{name}_rank{rank}.pt", weights_only=True)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("rank", [0, 1])
def test_resumed_run_ends_bit_for_bit_where_the_straight_run_does(runs, rank):
    straight, resumed = _report(runs, "straight", rank), _report(runs, "resumed", rank)
    assert resumed["sent"] > 0, "the hook never ran after resuming"
    assert straight["step"] == resumed["step"] == 8  # the hook's step counter came back too
    assert _equal(straight["params"], resumed["params"]), f"rank {rank}: the resumed run's parameters differ"


@pytest.mark.parametrize("rank", [0, 1])
def test_without_the_hook_state_the_resumed_run_differs(runs, rank):
    straight, dropped = _report(runs, "straight", rank), _report(runs, "no_restore", rank)
    assert dropped["step"] == 4  # a fresh hook state: 4 steps of its own
    assert not _equal(straight["params"], dropped["params"]), "dropping the error feedback changed nothing"


def test_lightning_restores_the_checkpoint_before_on_fit_start(runs):
    for rank in (0, 1):
        assert _report(runs, "straight", rank)["events"] == ["on_fit_start"]
        assert _report(runs, "resumed", rank)["events"] == ["on_load_checkpoint", "on_fit_start"]


def test_checkpoint_holds_every_ranks_hook_state_as_plain_data(runs):
    (path,) = sorted((runs / "ckpt").glob("*.ckpt"))
    checkpoint = torch.load(path, weights_only=True)  # Lightning's whole file, commpress's entry included
    state = checkpoint["commpress"]["ddp_hook"]  # the DDP hook, the part commpress.register applied
    assert state["world_size"] == 2
    assert [part["rank"] for part in state["ranks"]] == [0, 1]
    assert all(part["step"] == 4 for part in state["ranks"])
    residuals = [part["compressors"]["main"]["residuals"] for part in state["ranks"]]
    assert residuals[0].keys() == residuals[1].keys() and residuals[0]
    assert not torch.equal(residuals[0]["net.0.weight"], residuals[1]["net.0.weight"])  # error feedback differs per rank
    assert checkpoint["global_step"] == 4
