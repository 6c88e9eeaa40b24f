"""DiLoCo's trade at small scale: a small llama on the built-in corpus, M islands of one rank each for H in a list,
against data parallel over the same ranks: final validation loss, bytes on the replica (DiLoCo) or dp
communicator, wall time, under a simulated link (runtime.replica_link) for DiLoCo.
    mpiexec -n 4 python benchmarks/bench_diloco.py --steps 200 --H 1 10 50 100
"""
from __future__ import annotations

import argparse
import json
import time

from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.run.build import build

MODEL = ["model.kind=llama", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64",
         "model.ffn_hidden=128", "train.global_batch=16", "optim.lr=3e-3", "optim.warmup_steps=10",
         "train.eval_batches=4"]


def one(world, steps: int, extra: list) -> dict:
    eng = build(load_config(None, MODEL + [f"train.steps={steps}", *extra]), world)
    world.Barrier()
    t0 = time.perf_counter()
    for s in range(steps):
        eng.train_step(s)
    world.Barrier()
    wall = time.perf_counter() - t0
    val = eng.evaluate()[0]
    axis = "replica" if "replica" in eng.mesh.comms else "dp"
    sent = sum(b for _, b in eng.mesh.comms[axis].stats.values())
    # mean over the islands of their validation loss (the last outer step's model when steps is a multiple of H)
    val = world.allreduce(val) / world.Get_size()
    eng.mesh.free()
    return {"val_loss": val, "bytes": sent, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--H", type=int, nargs="+", default=[1, 10, 50, 100])
    ap.add_argument("--link", default="1Gbit/s,50ms")
    ap.add_argument("--quantize", default="none")
    a = ap.parse_args()
    world = MPI.COMM_WORLD
    rows = [{"run": "dp", **one(world, a.steps, ["strategy.data_parallel.enable=true"])}]
    for H in a.H:
        rows.append({"run": f"diloco H={H}", **one(world, a.steps, [
            "strategy.diloco.enable=true", f"strategy.diloco.inner_steps={H}",
            f"strategy.diloco.quantize={a.quantize}", f"runtime.replica_link={a.link}"])})
    if world.Get_rank() == 0:
        dp = rows[0]
        print(f"{'run':>16} {'val loss':>9} {'bytes/rank':>12} {'vs dp':>8} {'wall s':>8}")
        for r in rows:
            print(f"{r['run']:>16} {r['val_loss']:9.4f} {r['bytes']:12,d} {r['bytes'] / dp['bytes']:8.4f} "
                  f"{r['wall_s']:8.1f}")
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
