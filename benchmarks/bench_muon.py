"""A Muon step against an AdamW step of the same layout: the reference GPT at global batch 64 (8,192 tokens), one
process, data parallel or sharding. Per world size one `mpiexec` job builds and times each optimizer's engine in turn, round
after round: median step (slowest rank), the median of each round's Muon / AdamW, Newton-Schulz time on rank 0.
    .venv/bin/python benchmarks/bench_muon.py --rounds 5       # 1 and 2 ranks; a Markdown table
    .venv/bin/python benchmarks/bench_muon.py --ranks 4 --layout sharding --stage 2
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
GPT = ["model.kind='gpt'", "model.vocab_size=256", "model.d_model=256", "model.n_layers=4", "model.n_heads=4",
       "model.seq_len=128", "model.ffn_mult=4", "model.tie_head=false", "model.dtype='float32'",
       "runtime.backend='numpy'", "train.eval_every=0", "checkpoint.at_end=false"]
OPTIMIZERS = ("adamw", "muon")


def worker(a) -> None:
    from mpi4py import MPI  # noqa: PLC0415 - the driver runs without MPI

    from hpengine.config.load import load_config  # noqa: PLC0415
    from hpengine.optim import muon  # noqa: PLC0415
    from hpengine.run.build import build  # noqa: PLC0415

    world = MPI.COMM_WORLD
    spent = [0.0]
    raw = muon.newton_schulz

    def timed(*args, **kw):         # Muon.step looks the iteration up in its module at each call
        t = time.perf_counter()
        out = raw(*args, **kw)
        spent[0] += time.perf_counter() - t
        return out
    muon.newton_schulz = timed
    runs = {o: [] for o in OPTIMIZERS}
    for _ in range(a.rounds):
        for o in OPTIMIZERS:
            sets = GPT + [f"train.global_batch={a.batch}", f"optim.name='{o}'"]
            if world.Get_size() > 1:
                sets += (["strategy.sharding.enable=true", f"strategy.sharding.stage={a.stage}"]
                         if a.layout == "sharding" else ["strategy.data_parallel.enable=true"])
            eng = build(load_config(None, sets), world)
            for s in range(a.warmup):
                eng.train_step(s)
            steps, ns = [], []
            for s in range(a.warmup, a.warmup + a.steps):
                spent[0] = 0.0
                world.Barrier()
                t = time.perf_counter()
                eng.train_step(s)
                steps.append(world.allreduce(time.perf_counter() - t, op=MPI.MAX))
                ns.append(spent[0])
            runs[o].append({"step_s": statistics.median(steps), "ns_s": statistics.median(ns)})
            eng.mesh.free()
    if world.Get_rank() == 0:
        Path(a.json).write_text(json.dumps(runs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    ap.add_argument("--layout", choices=("dp", "sharding"), default="dp", help="over more than one rank: data "
                    "parallel (default) or sharding")
    ap.add_argument("--stage", type=int, default=1, help="the sharding stage with --layout sharding (default 1)")
    ap.add_argument("--mpi-args", default="", help="more mpiexec arguments (Open MPI on fewer cores than ranks: "
                    "'--oversubscribe', whose idle ranks yield their core instead of spinning)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    bin_ = Path(sys.executable).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    lines = [f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores; `python {' '.join(sys.argv)}`; "
             f"{a.rounds} rounds, {a.steps} timed steps after {a.warmup}, one BLAS thread per rank", "",
             "| ranks | AdamW step (s) | Muon step (s) | Muon / AdamW | per round | Newton-Schulz per step, rank 0 (s) "
             "| NS / 1 rank's |", "|---|---|---|---|---|---|---|"]
    one = None
    for n in a.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            subprocess.run([str(bin_ / "mpiexec"), *a.mpi_args.split(), "-n", str(n), sys.executable,
                            str(Path(__file__).resolve()), "--worker", "--rounds", str(a.rounds), "--steps", str(a.steps), "--warmup",
                            str(a.warmup), "--batch", str(a.batch), "--layout", a.layout, "--stage", str(a.stage),
                            "--json", str(out)], check=True, env=env, cwd=tmp)
            runs = json.loads(out.read_text())
        med = lambda o, k: statistics.median(r[k] for r in runs[o])  # noqa: E731
        ns = med("muon", "ns_s")
        one = ns if one is None and n == 1 else one
        # each round's Muon / AdamW (built and timed back to back): what a burst of other work skews least
        rounds = sorted(m["step_s"] / w["step_s"] for m, w in zip(runs["muon"], runs["adamw"]))
        lines.append(f"| {n} | {med('adamw', 'step_s'):.3f} | {med('muon', 'step_s'):.3f} | "
                     f"{statistics.median(rounds):.2f}x | {', '.join(f'{r:.2f}' for r in rounds)} | {ns:.3f} | "
                     f"{f'{ns / one:.2f}x' if one else '-'} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
