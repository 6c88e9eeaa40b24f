"""The planner's predicted step time against `hpengine train`'s measured one, for layouts of a small GPT
at several world sizes. Each repeat, per world size N: `mpiexec -n N hpengine plan --calibrate` measures
this machine, then every layout trains a few steps under `mpiexec -n N hpengine train` (median step_ms of
metrics.jsonl after the warm-up steps) and is predicted from that repeat's calibration. Repeats
interleave; the table gives medians, the ratio, whether it is within 30%, and whether the prediction
orders every two layouts whose measured times differ by more than 30% as they measured; the exit status
is 1 when either fails. Not part of `make test`: on a shared machine another job's processes decide the
step times (the same layout measured 28 ms and 54 ms in two attempts beside one busy loop), so run it on
a quiet one.

    .venv/bin/python benchmarks/bench_plan.py                    # -n 4, 2 and 1; 3 repeats
    .venv/bin/python benchmarks/bench_plan.py --ranks 4 --repeats 5 --set model.d_model=64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_all import DP, ROOT, SP, THREADS, TP2, _why, pipeline, sharding

from hpengine.config.load import load_config
from hpengine.planner.search import predict_layout, load_cluster
from hpengine.layout.resolve import resolve

MODEL = ["model.kind=gpt", "model.d_model=128", "model.seq_len=64", "model.n_layers=4", "model.n_heads=4",
         "model.dtype=float32", "train.global_batch=8", "train.eval_every=0", "train.log_every=1000",
         "runtime.backend=numpy"]
LAYOUTS = {4: [("dp 4", DP), ("sharding 2 x 4", sharding(2)), ("sharding 3 x 4", sharding(3)),
               ("pp 2 (1f1b, m 4) x dp 2", pipeline(2, 4) + DP), ("tp 2 x dp 2", TP2 + DP),
               ("tp 2 x pp 2 (1f1b, m 4)", TP2 + pipeline(2, 4)), ("tp 2 sp x dp 2", TP2 + SP + DP)],
           2: [("dp 2", DP), ("sharding 3 x 2", sharding(3)), ("pp 2 (1f1b, m 4)", pipeline(2, 4)), ("tp 2", TP2),
               ("tp 2 sp", TP2 + SP)],
           1: [("1 process", [])]}
TOLERANCE = 0.30


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 2, 1], choices=sorted(LAYOUTS))
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median (default 3)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="model/config override for every layout, e.g. --set model.d_model=64 (repeatable)")
    p.add_argument("--mpiexec", default=str(Path(sys.executable).parent / "mpiexec"))
    p.add_argument("--timeout", type=float, default=300, help="seconds per command before it counts as failed")
    return p.parse_args(argv)


def mpirun(a, n, args) -> subprocess.CompletedProcess:
    cmd = [a.mpiexec, "-n", str(n), sys.executable, "-m", "hpengine", *args]
    env = dict(os.environ, **{v: os.environ.get(v, "1") for v in THREADS})
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
    if p.returncode:
        raise RuntimeError(f"{' '.join(args[:2])} at -n {n}: {_why(p)}")
    return p


def measured_s(a, n, overrides, out: Path) -> float:
    """Median step seconds of one `hpengine train` run after the warm-up steps (rank 0's metrics)."""
    sets = [x for o in [*MODEL, *a.overrides, *overrides, f"train.steps={a.steps}", f"train.out_dir={out}"]
            for x in ("--set", o)]
    mpirun(a, n, ["train", *sets])
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(m["step_ms"] for m in lines[a.warmup:]) / 1e3


def one_round(a, n, tmp: Path) -> dict:
    """{layout: (predicted s, measured s)} from a fresh calibration and one run of each layout."""
    path = tmp / f"cluster-{n}-{len(os.listdir(tmp))}.toml"
    path.write_text(mpirun(a, n, ["plan", "--calibrate"]).stdout)
    cluster, out = load_cluster(str(path)), {}
    for name, overrides in LAYOUTS[n]:
        cfg = load_config(None, [*MODEL, *a.overrides, *overrides])
        predicted = predict_layout(cfg, resolve(cfg, n), cluster)["time"]["step"]
        out[name] = (predicted, measured_s(a, n, overrides, tmp / f"run-{len(os.listdir(tmp))}"))
    return out


def table(n: int, rounds: list[dict]) -> tuple[str, bool]:
    """The Markdown table of one world size, and whether every prediction is within 30% and ranks the
    layouts as measured."""
    med = {name: tuple(statistics.median(r[name][i] for r in rounds) for i in (0, 1)) for name, _ in LAYOUTS[n]}
    lines = [f"mpiexec -n {n}, medians of {len(rounds)} round(s):", "",
             "| layout | predicted ms | measured ms | predicted / measured | within 30% |",
             "|---|---:|---:|---:|---|"]
    ok = True
    for name, (p, m) in med.items():
        within = abs(p / m - 1) <= TOLERANCE
        ok &= within
        lines.append(f"| {name} | {p * 1e3:.1f} | {m * 1e3:.1f} | {p / m:.2f} | {'yes' if within else 'NO'} |")
    pairs = [(x, y) for x in med for y in med if med[x][1] > (1 + TOLERANCE) * med[y][1]]
    wrong = [f"{x} > {y}" for x, y in pairs if not med[x][0] > med[y][0]]
    ok &= not wrong
    lines += ["", f"rank agreement: {len(pairs) - len(wrong)} of {len(pairs)} pairs that differ by more than 30% "
              "in measured time are predicted in the same order"
              + (f"; misordered: {', '.join(wrong)}" if wrong else "")]
    return "\n".join(lines), ok


def main(argv=None) -> int:
    a = parse(argv)
    results = {n: [] for n in a.ranks}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hpengine-bench-plan-") as tmp:
        for rep in range(a.repeats):
            for n in a.ranks:
                print(f"round {rep + 1} of {a.repeats}, -n {n} ({time.perf_counter() - t0:.0f} s)", flush=True)
                results[n].append(one_round(a, n, Path(tmp)))
    good = True
    for n in a.ranks:
        text, ok = table(n, results[n])
        good &= ok
        print("\n" + text)
    m, b = (lambda c: (c.model, c.train.global_batch))(load_config(None, [*MODEL, *a.overrides]))
    print(f"\nsmall GPT: d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, seq {m.seq_len}, {m.dtype}, "
          f"global batch {b}; {a.steps} steps per run, the first {a.warmup} left out; "
          f"{time.perf_counter() - t0:.0f} s in all")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
