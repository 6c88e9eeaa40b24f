"""Zero-bubble pipeline schedules against 1F1B and interleaved 1F1B: the reference model's shape (byte vocab,
d_model 256, 4 heads, seq 128, float32) with 8 layers (so that pp 4 can hold zbv's and interleaved's two chunks
per rank) and a global batch of 16, at pp 2 and pp 4 with m = 4 and 8 micro-batches. For each layout one
`mpiexec -n p` job builds every schedule's engine in turn, round after round (the schedules interleaved),
warms each up, times its steps, and reports per schedule the median tokens/s, the measured bubble (the idle
share of p x the pass's span from the first stage's start to the last stage's end, 1 - sum of busy / (p x
span), median over steps) next to the schedule's theory; per stage, the idle share of that stage's own
executor time, which `hpengine train`'s end-of-run line shows (it leaves out the waits before a stage's
first action and after its last: a last stage that finishes early looks busier than it was); and the
measured time of one B and one W relative to one F (the engine's phase clock); the activation peak of the
worst rank (the engine's count: caches, and under a zero-bubble schedule the W stash). Prints a Markdown
table; not part of `make test`.

    .venv/bin/python benchmarks/bench_zero_bubble.py                     # pp 2 and 4, m 4 and 8, 3 rounds
    .venv/bin/python benchmarks/bench_zero_bubble.py --pp 2 --m 8 --rounds 5 --out /tmp/zb.md

On a 2-core machine pp 4 puts two ranks on each core: its figures measure the schedules under
oversubscription (a waiting rank spins on its core), not the bubble alone.
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
from pathlib import Path

from _machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("1f1b", "interleaved", "zb1p", "zbv")
MODEL = ["model.n_layers=8", "train.global_batch=16", "train.eval_every=0"]


def overrides(p: int, m: int, schedule: str) -> list[str] | None:
    """The config of one case, or None where the schedule cannot take it (one line of why in the table)."""
    o = ["strategy.pipeline.enable=true", f"strategy.pipeline.degree={p}", f"strategy.pipeline.micro_batches={m}",
         f"strategy.pipeline.schedule={schedule}"]
    if schedule == "interleaved":
        if m % p:
            return None
        o.append("strategy.pipeline.virtual_stages=2")
    if schedule == "zbv" and m < 2 * p - 1:
        return None
    return MODEL + o


def worker(a) -> None:
    """Under mpiexec: every schedule of pp a.pp, m in a.m, interleaved over a.rounds rounds."""
    from mpi4py import MPI  # noqa: PLC0415 - the driver runs without MPI

    from hpengine.config.load import load_config  # noqa: PLC0415
    from hpengine.layout.schedules import bubble_fraction  # noqa: PLC0415
    from hpengine.run.build import build  # noqa: PLC0415

    world, p = MPI.COMM_WORLD, a.pp
    results = {}
    for _ in range(a.rounds):
        for m in a.m:
            for sched in SCHEDULES:
                o = overrides(p, m, sched)
                if o is None:
                    continue
                cfg = load_config(None, o)
                eng = build(cfg, world)
                for s in range(a.warmup):
                    eng.train_step(s)
                pipe, tr = eng.pipe, eng.tracer
                pipe.busy_s = pipe.wall_s = 0.0
                tr.seconds.clear()
                toks, wide = [], []
                for s in range(a.warmup, a.warmup + a.steps):
                    toks.append(eng.train_step(s)["tokens_per_s"])
                    runs = world.allgather(pipe.last_run)       # (start, end, busy) of every stage's pass
                    window = max(r[1] for r in runs) - min(r[0] for r in runs)
                    wide.append(1 - sum(r[2] for r in runs) / (p * window))
                mine = (1 - pipe.busy_s / pipe.wall_s, tr.seconds.get("forward", 0.0), tr.seconds.get("backward", 0.0),
                        tr.seconds.get("weights", 0.0), eng.memory()["activation_peak_bytes"])
                every = world.allgather(mine)
                if world.Get_rank() == 0:
                    r = results.setdefault(f"{m} {sched}", {"m": m, "schedule": sched, "v": eng.res.v, "runs": []})
                    r["theory"] = bubble_fraction(sched, p, m, eng.res.v)
                    f, b, w = (sum(e[i] for e in every) for i in (1, 2, 3))
                    r["runs"].append({"tokens_per_s": statistics.median(toks), "bubble": statistics.median(wide),
                                      "bubble_per_stage": [round(e[0], 4) for e in every],
                                      # per action: a zero-bubble B or W is one chunk's, as its F
                                      "b_over_f": b / f, "w_over_f": w / f if w else None,
                                      "activations_mib": max(e[4] for e in every) / 2**20})
                eng.mesh.free()
    if world.Get_rank() == 0:
        Path(a.json).write_text(json.dumps(list(results.values())))


def summarize(p: int, cases: list[dict]) -> list[str]:
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    base = {c["m"]: med([r["tokens_per_s"] for r in c["runs"]]) for c in cases if c["schedule"] == "1f1b"}
    bub1 = {c["m"]: med([r["bubble"] for r in c["runs"]]) for c in cases if c["schedule"] == "1f1b"}
    rows = []
    for c in sorted(cases, key=lambda c: (c["m"], SCHEDULES.index(c["schedule"]))):
        tok, bub = med([r["tokens_per_s"] for r in c["runs"]]), med([r["bubble"] for r in c["runs"]])
        stages = [med([r["bubble_per_stage"][s] for r in c["runs"]]) for s in range(p)]
        bf = med([r["b_over_f"] for r in c["runs"]])
        act = med([r["activations_mib"] for r in c["runs"]])
        wf = [r["w_over_f"] for r in c["runs"] if r["w_over_f"] is not None]
        rows.append(f"| {p} | {c['m']} | {c['schedule']}{'/2' if c['v'] > 1 else ''} | {bub:.3f} | "
                    f"{' '.join(f'{b:.3f}' for b in stages)} | {c['theory']:.3f} | {bub / bub1[c['m']]:.2f} | "
                    f"{tok:,.0f} | {tok / base[c['m']]:.2f} | {act:.1f} | {bf:.2f} | " + (f"{med(wf):.2f} |" if wf else "- |"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every schedule once (default 3)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default 2)")
    ap.add_argument("--out", default=None, help="also write the table here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.pp = a.pp[0]
        worker(a)
        return 0
    bin_ = Path(sys.executable).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    lines = [f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores; `{' '.join(['python', *sys.argv])}`; "
             f"{a.rounds} rounds, {a.steps} timed steps after {a.warmup} per run, one BLAS thread per rank", "",
             "| pp | m | schedule | bubble | per stage | theory | / 1f1b's | tokens/s | / 1f1b | activations MiB | B / F | "
             "W / F |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in a.pp:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            cmd = [str(bin_ / "mpiexec"), "-n", str(p), sys.executable, str(Path(__file__).resolve()), "--worker",
                   "--pp", str(p), "--m", *map(str, a.m), "--rounds", str(a.rounds), "--steps", str(a.steps),
                   "--warmup", str(a.warmup), "--json", str(out)]
            subprocess.run(cmd, check=True, env=env, cwd=tmp)
            lines += summarize(p, json.loads(out.read_text()))
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
