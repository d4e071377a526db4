"""A CommState built before Lightning spawns its ranks reaches each of them pickled, and
trains there (issue 40: a state pickled before its first bucket failed on every rank).

``DDPStrategy(start_method="spawn", ddp_comm_state=CommState(...), ddp_comm_hook=ddp_hook)``
on 2 CPU ranks (gloo). Lightning pickles the Trainer, strategy and state into the spawned
processes, as PyTorch's own ``PowerSGDState`` is. Lightning 2.6 registers the comm hook
only on CUDA, so the strategy here registers it on CPU too, through Lightning's own
registration function with the state that arrived in the child. Each rank writes what its
state did; the parent checks that the hook sent bytes on both ranks and that training took
place (the parameters moved, and identically on both ranks).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiproc

STEPS = 3

DRIVER = textwrap.dedent(
    f'''
    import os
    import sys
    from pathlib import Path

    import lightning as L
    import torch
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies import DDPStrategy

    import commpress

    OUT = Path(sys.argv[1])
    PARENT = os.getpid()


    class HooksOnCPU(DDPStrategy):
        """Lightning's DDPStrategy, registering its comm hook on CPU as it does on CUDA."""

        def _register_ddp_hooks(self):
            _register_ddp_comm_hook(
                model=self.model, ddp_comm_state=self._ddp_comm_state, ddp_comm_hook=self._ddp_comm_hook
            )


    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
            self.initial = [p.detach().clone() for p in self.net.parameters()]

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_end(self):
            state = self.trainer.strategy._ddp_comm_state
            report = {{
                "pid": os.getpid(),
                "sent": state.traffic.bytes_sent,
                "hook_steps": state.step,
                "global_step": self.trainer.global_step,
                "moved": [not torch.equal(a, p.detach()) for a, p in zip(self.initial, self.net.parameters())],
                "params": [p.detach().clone() for p in self.net.parameters()],
            }}
            torch.save(report, OUT / f"rank{{self.global_rank}}.pt")


    if __name__ == "__main__":
        L.seed_everything(0, verbose=False)
        state = commpress.CommState({{"method": "fp16"}})  # before any process group: pickled into the ranks
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
        strategy = HooksOnCPU(
            start_method="spawn", process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=commpress.ddp_hook
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps={STEPS},
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=OUT,
        )
        trainer.fit(Tiny(), data)
        torch.save({{"pid": PARENT, "hook_steps": state.step}}, OUT / "parent.pt")
    '''
)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lightning_spawn")
    (out / "driver.py").write_text(DRIVER)
    env = dict(os.environ, OMP_NUM_THREADS="1")  # 2 ranks on a small machine: no oversubscribed torch threads
    env.pop("MASTER_PORT", None)  # Lightning picks a free port
    proc = subprocess.run([sys.executable, "driver.py", str(out)], cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the Lightning spawn run exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return out


def _report(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_pickled_state_sends_through_the_hook_on_every_rank(run, rank):
    parent, report = _report(run, "parent"), _report(run, f"rank{rank}")
    assert report["pid"] != parent["pid"], "the rank ran in the parent process: nothing was pickled"
    assert parent["hook_steps"] == 0, "the parent's own state reduced: the ranks did not use their pickled copies"
    assert report["sent"] > 0, f"rank {rank}: nothing went through the commpress hook"
    assert report["hook_steps"] == report["global_step"] == STEPS  # one reduction per step, every step trained


def test_training_moved_every_parameter_identically_on_both_ranks(run):
    ranks = [_report(run, f"rank{r}") for r in (0, 1)]
    assert all(all(r["moved"]) for r in ranks), "a parameter did not change: no training took place"
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"])), "the replicas differ"
