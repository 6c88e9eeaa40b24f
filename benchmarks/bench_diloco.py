"""DiLoCo's trade at small scale: a small llama on the built-in corpus, M islands of one rank each for H in a list,
against data parallel over the same ranks, both over one simulated link (runtime.replica_link on the replica or the
dp communicator): final validation loss, bytes on that communicator, wall time. --out writes a run folder per run.
    mpiexec -n 4 python benchmarks/bench_diloco.py --steps 600 --H 1 10 50 100 --int8 50 --out runs/diloco_h
--warm W starts the DiLoCo runs from the data-parallel run's state after W steps, as DiLoCo's paper does.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.run.build import build
from hpengine.run.train import restore, save_state

MODEL = ["model.kind=llama", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64",
         "model.ffn_hidden=128", "optim.warmup_steps=20", "train.eval_batches=4"]


def wire_bytes(stats: dict, m: int) -> int:
    """What one rank sends under ring or pairwise algorithms: an allreduce of b bytes 2 (m-1)/m b, an allgather of b
    bytes (the gathered buffer) (m-1)/m b, an alltoallv of b bytes (its send buffer, equal parts) (m-1)/m b, anything
    else its bytes."""
    per = {"allreduce": 2 * (m - 1) / m, "allgather": (m - 1) / m, "alltoallv": (m - 1) / m}
    return int(sum(per.get(op, 1.0) * b for op, (_, b) in stats.items()))


def one(world, name: str, a, extra: list, warm: dict | None = None) -> dict:
    """One run of a.steps steps. warm: {"dir": a folder}: the run saves its state after a.warm steps there (the
    data-parallel run) or, holding "path", starts from that saved state (a DiLoCo run after the common warm-up)."""
    steps, eval_every, out = a.steps, a.eval_every, a.out
    cfg = load_config(None, MODEL + [f"train.steps={steps}", f"train.global_batch={a.batch}", f"optim.lr={a.lr}",
                                     *extra])
    eng = build(cfg, world)
    axis = "replica" if "replica" in eng.mesh.comms else "dp"
    comm = eng.mesh.comms[axis]
    rows, wall, first = [], 0.0, 0
    if warm and "path" in warm:
        first = restore(eng, cfg, warm["path"])
    for s in range(first, steps):
        if warm and "path" not in warm and s == a.warm:
            warm.update(path=save_state(eng, warm["dir"], s, 1), bytes=sum(b for _, b in comm.stats.values()),
                        wire=wire_bytes(comm.stats, comm.size))
        world.Barrier()
        t0 = time.perf_counter()
        m = eng.train_step(s)
        world.Barrier()
        wall += time.perf_counter() - t0
        row = {"step": s + 1, "loss": float(m["loss"])}
        if (s + 1) % eval_every == 0 or s + 1 == steps:
            # the mean over the islands of their models' validation loss (the outer model after an outer step)
            row["val_loss"] = world.allreduce(eng.evaluate()[0]) / world.Get_size()
        rows.append(row)
        if world.Get_rank() == 0 and "val_loss" in row:
            print(f"{name} step {s + 1}: val loss {row['val_loss']:.4f}, {wall:.0f} s", file=sys.stderr, flush=True)
    sent = sum(b for _, b in comm.stats.values())
    wire = wire_bytes(comm.stats, comm.size)
    held = world.allreduce(getattr(comm, "waited_s", 0.0), op=MPI.MAX)      # the longest any rank slept on the link
    eng.mesh.free()
    if out is not None and world.Get_rank() == 0:
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "config.toml").write_text(f"[train]\nglobal_batch = {a.batch}\n[model]\nseq_len = 64\n")
    return {"val_loss": rows[-1]["val_loss"], "bytes": sent, "wire": wire, "wall_s": wall, "link_s": held}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16, help="train.global_batch of every run (the islands split it)")
    ap.add_argument("--lr", type=float, default=3e-3, help="optim.lr of every run (the islands' inner AdamW)")
    ap.add_argument("--H", type=int, nargs="*", default=[1, 10, 50, 100])
    ap.add_argument("--int8", type=int, nargs="*", default=[50], help="the H values also run with int8")
    ap.add_argument("--link", default="1Gbit/s,50ms")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None, help="a run folder per run here, for `hpengine plot`")
    ap.add_argument("--dp", action=argparse.BooleanOptionalAction, default=True, help="the data-parallel run")
    ap.add_argument("--set", dest="extra", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more settings of the DiLoCo runs (outer_lr, overlap, ...)")
    ap.add_argument("--tag", default="", help="appended to the DiLoCo runs' names")
    ap.add_argument("--warm", type=int, default=0, help="the DiLoCo runs start from the data-parallel run's state "
                    "after this many steps (DiLoCo's paper starts from a pretrained model); their bytes include those "
                    "steps' data-parallel bytes")
    a = ap.parse_args()
    world = MPI.COMM_WORLD
    link = [f"runtime.replica_link={a.link}"]
    runs = [("dp", ["strategy.data_parallel.enable=true", "runtime.link_axis=dp", *link])] if a.dp else []
    for H, q in [(H, "none") for H in a.H] + [(H, "int8") for H in a.int8]:
        runs.append((f"diloco_H{H}" + ("_int8" if q != "none" else "") + a.tag, [
            "strategy.diloco.enable=true", "strategy.diloco.replicas=-1", f"strategy.diloco.inner_steps={H}",
            f"strategy.diloco.quantize={q}", *link, *a.extra]))
    if a.warm and not a.dp:
        ap.error("--warm needs the data-parallel run (--dp), whose state the DiLoCo runs start from")
    rows = []
    warm = None
    if a.warm:          # one folder for the job, made by rank 0
        made = tempfile.mkdtemp(prefix="bench_diloco_warm_") if world.Get_rank() == 0 else None
        warm = {"dir": Path(world.bcast(made, root=0))}
    for name, extra in runs:
        r = one(world, name, a, extra, warm if name == "dp" or a.warm else None)
        if warm and name != "dp":       # the warm-up's data-parallel traffic is part of the run
            r.update(phase_bytes=r["bytes"], phase_wire=r["wire"], bytes=r["bytes"] + warm["bytes"],
                     wire=r["wire"] + warm["wire"])
        rows.append({"run": name, **r})
        if world.Get_rank() == 0:
            print(json.dumps(rows[-1]), flush=True)
    if world.Get_rank() == 0 and a.dp:
        dp = rows[0]
        print("| run | final val loss | vs dp | bytes/rank (counted) | dp / this | wire bytes/rank | dp / this | "
              "wall s | held on the link s |\n|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['run']} | {r['val_loss']:.4f} | {100 * (r['val_loss'] / dp['val_loss'] - 1):+.2f} % | "
                  f"{r['bytes']:,d} | {dp['bytes'] / r['bytes']:.1f}x | {r['wire']:,d} | "
                  f"{dp['wire'] / r['wire']:.1f}x | {r['wall_s']:.1f} | {r['link_s']:.1f} |")
        if warm:
            print(f"after the {a.warm}-step warm-up, data parallel's wire bytes over each DiLoCo run's: " + ", ".join(
                f"{r['run']} {(dp['wire'] - warm['wire']) / r['phase_wire']:.1f}x" for r in rows[1:]))


if __name__ == "__main__":
    main()
