"""Expert parallel against replicated experts: configs/moe_small.toml's model (8 experts of width 256, top 2,
the first layer dense) under data parallel over n ranks, with ep = 1 (every rank holds every expert) and ep
= 2, 4 up to n (experts split, rows moved by all-to-all). One `mpiexec -n n` job per world size builds each
layout's engine in turn, round after round (interleaved), warms it up and times its steps; per layout the
median tokens/s, the all-to-all bytes per step and rank, the share of the step the all-to-alls take (timed
around each call on rank 0), and the parameters, gradients and Adam moments of the largest rank (what ep
divides). Then one more job per layout alone, for its peak RSS per rank (the largest rank's; a process's
peak covers every engine it built, so each layout needs its own processes). Prints a Markdown table; not part
of `make test`.

    .venv/bin/python benchmarks/bench_moe_ep.py                 # -n 2 and 4, 3 rounds
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


def worker(a) -> None:
    from mpi4py import MPI  # noqa: PLC0415 - the driver runs without MPI

    from hpengine.config.load import load_config  # noqa: PLC0415
    from hpengine.run.build import build  # noqa: PLC0415

    world = MPI.COMM_WORLD
    n = world.Get_size()
    eps = [e for e in (1, 2, 4, 8) if e <= n and n % e == 0 and (a.only is None or e == a.only)]
    runs = {e: [] for e in eps}
    for _ in range(a.rounds):
        for e in eps:
            sets = ["train.eval_every=0", f"train.global_batch={a.batch}", "checkpoint.at_end=false"]
            if e > 1:
                sets += ["strategy.expert_parallel.enable=true", f"strategy.expert_parallel.degree={e}"]
            eng = build(load_config(ROOT / "configs" / "moe_small.toml", sets), world)
            for s in range(a.warmup):
                eng.train_step(s)
            ep = eng.mesh.comms.get("ep")
            spent = [0.0]
            if ep is not None:          # time every all-to-all of this rank
                ep.reset_stats()
                raw = ep.alltoallv_

                def timed(*args, raw=raw):
                    t = time.perf_counter()
                    out = raw(*args)
                    spent[0] += time.perf_counter() - t
                    return out
                ep.alltoallv_ = timed
            toks, t0 = [], time.perf_counter()
            for s in range(a.warmup, a.warmup + a.steps):
                toks.append(eng.train_step(s)["tokens_per_s"])
            wall = time.perf_counter() - t0
            sent = ep.stats["alltoallv"][1] / a.steps if ep is not None else 0
            mem = eng.memory()     # (peak RSS would be the whole process's, every layout's before this one)
            state = max(world.allgather(mem["param_bytes"] + mem["grad_bytes"] + mem["optim_bytes"]))
            runs[e].append({"tokens_per_s": statistics.median(toks), "a2a_share": spent[0] / wall,
                            "a2a_mib": sent / 2**20, "state_mib": state / 2**20})
            rss = max(world.allgather(eng.memory()["peak_rss_bytes"]))
            runs[e][-1]["rss_mib"] = rss / 2**20
            eng.mesh.free()
    if world.Get_rank() == 0:
        Path(a.json).write_text(json.dumps(runs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="global batch (default 8, the config's)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--only", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    bin_ = Path(sys.executable).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cpu = cpu_name()
    lines = [f"{datetime.date.today()}, {cpu}, {os.cpu_count()} cores; `python {' '.join(sys.argv)}`; {a.rounds} "
             f"rounds, {a.steps} timed steps after {a.warmup}, one BLAS thread per rank", "",
             "| ranks | ep | tokens/s | / ep 1 | all-to-all MiB per step and rank | all-to-all share | "
             "model state MiB per rank | peak RSS MiB (largest rank) |",
             "|---|---|---|---|---|---|---|---|"]
    def job(n, rounds, only=None):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            subprocess.run([str(bin_ / "mpiexec"), "-n", str(n), sys.executable, str(Path(__file__).resolve()),
                            "--worker", "--rounds", str(rounds), "--steps", str(a.steps), "--warmup", str(a.warmup),
                            "--batch", str(a.batch), "--json", str(out)] + (["--only", str(only)] if only else []),
                           check=True, env=env, cwd=tmp)
            return json.loads(out.read_text())
    for n in a.ranks:
        runs = job(n, a.rounds)
        rss = {e: job(n, 1, int(e))[e][0]["rss_mib"] for e in runs}
        med = lambda e, k: statistics.median(r[k] for r in runs[e])  # noqa: E731
        for e in runs:
            lines.append(f"| {n} | {e} | {med(e, 'tokens_per_s'):,.0f} | {med(e, 'tokens_per_s') / med('1', 'tokens_per_s'):.2f} "
                         f"| {med(e, 'a2a_mib'):.2f} | {med(e, 'a2a_share'):.1%} | {med(e, 'state_mib'):.1f} "
                         f"| {rss[e]:.0f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
