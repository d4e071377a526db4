"""(Run from the repository root with PYTHONPATH=.) Where a slow-link step's time goes beyond the computation alone: 2 gloo ranks on
loopback, the race's transformer; rank 0 times plain steps, DDP with the local hook only,
and the slow-link config, interleaved in blocks, and cProfiles the slow-link steps."""
import cProfile, io, pstats, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import commpress
from commpress.bench.race import RaceTask
from commpress.bench.launch import run_local
from commpress.local_sgd.ddp import skip_gradient_allreduce

STEPS = 40

def run(rank, world, config):
    task = RaceTask()
    data = task.data()
    def make(kind):
        torch.manual_seed(0)
        model = data.model()
        if kind == "plain":
            return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        if kind == "ddp_local":
            skip_gradient_allreduce(ddp)
        elif kind == "slow":
            commpress.register(ddp, config, optimizer=opt, total_steps=10_000)
        return ddp, opt
    rows = {k: make(k) for k in ("plain", "ddp_local", "slow", "ddp")}
    times = {k: [] for k in rows}
    prof = cProfile.Profile()
    step = 0
    for block in range(4):
        for kind, (model, opt) in rows.items():
            dist.barrier()
            for i in range(STEPS // 4 + 2):
                x, y = data.batch(step + i, rank, world)
                t0 = time.perf_counter()
                if kind == "slow" and rank == 0 and block > 0:
                    prof.enable()
                loss = task.loss(model(x), y)
                opt.zero_grad(set_to_none=False)
                loss.backward()
                opt.step()
                if kind == "slow" and rank == 0:
                    prof.disable()
                if i >= 2:  # the first steps after switching rows off the clock
                    times[kind].append(time.perf_counter() - t0)
        step += STEPS // 4 + 2
    out = {k: sorted(v)[len(v) // 2] * 1000 for k, v in times.items()}
    out["mean"] = {k: sum(v) / len(v) * 1000 for k, v in times.items()}
    if rank == 0:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        out["profile"] = s.getvalue()
    return out

if __name__ == "__main__":
    res = run_local(run, 2, sys.argv[1])
    for r in res:
        print({k: v for k, v in r.items() if k != "profile"})
    print(res[0]["profile"])
