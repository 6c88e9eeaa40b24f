"""PyTorch distributed peers of hpengine's data-parallel and stage-3 sharding runs: the reference model of
torch_ref.py (imported, not copied) trained by DDP or FSDP2 (`fully_shard`) over gloo on CPU, one
thread per rank, the global batch split across ranks (so a step does the same work as hpengine's dp or
sharding run with as many ranks). Warm-up steps, then timed steps, each started after a barrier; a step
lasts as long as its slowest rank; rank 0 reports the median tokens/s and the peak RSS of the largest
rank. torch is not an hpengine dependency: launch it with torchrun from a venv that has torch, e.g.

    $TORCH_PYTHON -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/torch_dist.py --mode ddp --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

from _threads import ensure_threads  # noqa: E402 - benchmarks/ is sys.path[0]
import torch_ref  # noqa: E402 - the model and optimizer, shared with the eager reference


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("ddp", "fsdp2"), default="ddp")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    # the model, optimizer, --steps, --threads and --json options are torch_ref.py's
    a, rest = p.parse_known_args(argv)
    a.__dict__.update(vars(torch_ref.parse(rest)))
    return a


def main(argv=None) -> int:
    a = parse(argv)
    ensure_threads(a.threads, __file__)
    try:
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415
    except ImportError:
        sys.exit(f"torch_dist.py: PyTorch is not installed for {sys.executable}; see benchmarks/README.md")
    if "RANK" not in os.environ:
        sys.exit("torch_dist.py: launch it with torchrun (python -m torch.distributed.run --standalone "
                 "--nproc-per-node N benchmarks/torch_dist.py ...)")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        return run(a, torch, dist, rank, world)
    except Exception as e:
        # the exact error, for bench_all.py's table (torchrun's own report buries it)
        if a.json:
            with open(f"{a.json}.rank{rank}.err", "w") as f:
                f.write(f"{type(e).__name__}: {e}".splitlines()[0][:300])
        raise
    finally:
        dist.destroy_process_group()


def run(a, torch, dist, rank, world) -> int:
    if a.batch % world:
        raise ValueError(f"global batch {a.batch} does not split over {world} ranks")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(1234)                                    # the same initial weights on every rank
    model, opt = torch_ref.build(a, torch)
    n_params = sum(p.numel() for p in model.parameters())
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415
        model = DistributedDataParallel(model)                  # same Parameter objects: opt stays valid
    else:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
        mesh = init_device_mesh("cpu", (world,))
        names = {id(p): n for n, p in model.named_parameters()}
        groups = [([names[id(p)] for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
                  for g in opt.param_groups]
        for b in model.blocks:                                  # one unit per block, the rest in the root
            fully_shard(b, mesh=mesh)                           # reshard_after_forward=True: ZeRO-3
        fully_shard(model, mesh=mesh)
        new = dict(model.named_parameters())                    # DTensor shards replace the parameters
        opt = type(opt)([{"params": [new[n] for n in ns], **hyper} for ns, hyper in groups])
    local = a.batch // world
    gen = torch.Generator().manual_seed(rank)

    def step():
        idx = torch.randint(0, a.vocab, (local, a.seq + 1), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()                                         # gradients averaged over ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # global norm (DTensor-aware for FSDP2)
        opt.step()
        return loss.item()

    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    loss = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(loss)                                       # the last step's loss on the global batch
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)             # a step lasts as long as its slowest rank
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        report(a, torch, world, n_params, slowest.tolist(), rss.item(), loss.item() / world)
    dist.barrier()                      # nobody tears gloo down while others still use it
    return 0


def report(a, torch, world, n_params, slowest, rss, loss) -> None:
    med = statistics.median(slowest)
    r = {"engine": f"torch-{a.mode}", "torch": torch.__version__, "ranks": world, "threads": torch.get_num_threads(),
         "n_params": n_params, "warmup_steps": a.warmup, "steps": a.steps, "median_step_ms": med * 1e3,
         "min_step_ms": min(slowest) * 1e3, "tokens_per_s": a.batch * a.seq / med,
         "peak_rss_bytes": int(rss), "last_loss": loss}
    print(f"torch {r['torch']} {a.mode} ranks={world} threads/rank={r['threads']} params={n_params:,}\n"
          f"step ms   median {r['median_step_ms']:.1f} | min {r['min_step_ms']:.1f}\n"
          f"tokens/s  {r['tokens_per_s']:,.0f} (median), last loss {r['last_loss']:.4f}\n"
          f"peak RSS  {r['peak_rss_bytes'] / 2**20:.0f} MiB (largest rank)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    rc = main()
    # skip interpreter finalization: now and then (1 run in ~8 at 4 ranks, torch 2.13) a gloo thread left
    # behind aborts it with "terminate called without an active exception" after everything is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
