"""Single-process throughput of hpengine's optimizer step (forward + backward + clip + AdamW).

Builds the engine through the public path (load_config -> train.build), warms up for --warmup-s
seconds, then times --steps optimizer steps one by one and reports the median tokens/s and the peak
RSS. --threads pins the BLAS/OpenMP thread count; it must be set before NumPy loads, so the script
re-executes itself when the environment does not already say so.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_core.py --steps 20 --json out.json
    .venv/bin/python benchmarks/bench_core.py --profile      # pyinstrument tree of the timed steps
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _threads import ensure_threads  # noqa: E402 - benchmarks/ is sys.path[0]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps (default 20)")
    p.add_argument("--warmup-s", type=float, default=5.0, help="untimed warm-up seconds (default 5)")
    p.add_argument("--threads", type=int, default=1, help="BLAS/OpenMP threads (default 1; 0 = leave)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override passed to hpengine, e.g. --set model.d_model=512 (repeatable)")
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    p.add_argument("--profile", action="store_true", help="profile the timed steps with pyinstrument")
    return p.parse_args(argv)




def warm_engine(overrides, warmup_s: float):
    """(config, engine, tokens per step, steps run): the engine of the built-in defaults with `overrides`,
    built through the public path and stepped for warmup_s seconds (at least one step)."""
    from hpengine.config.load import load_config  # noqa: PLC0415 - after the thread variables are set
    from hpengine.run.build import build  # noqa: PLC0415

    cfg = load_config(None, ["train.eval_every=0", *overrides])
    eng = build(cfg)
    step, t_end = 0, time.perf_counter() + warmup_s
    while step == 0 or time.perf_counter() < t_end:
        eng.train_step(step)
        step += 1
    return cfg, eng, cfg.train.global_batch * cfg.model.seq_len, step


def run(a) -> dict:
    cfg, eng, toks, step = warm_engine(a.overrides, a.warmup_s)
    warm_steps = step
    prof = None
    if a.profile:
        from pyinstrument import Profiler  # noqa: PLC0415 - optional (extra `bench`)
        prof = Profiler(interval=0.0005)
        prof.start()
    times, cpu = [], []
    for _ in range(a.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        eng.train_step(step)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        step += 1
    if prof is not None:
        prof.stop()
        print(prof.output_text(unicode=True, color=False, show_all=False))
    med = statistics.median(times)
    return {"engine": "hpengine", "model": cfg.model.kind, "d_model": cfg.model.d_model,
            "n_layers": cfg.model.n_layers, "n_heads": cfg.model.n_heads, "seq_len": cfg.model.seq_len,
            "global_batch": cfg.train.global_batch, "dtype": cfg.model.dtype, "n_params": eng.n_params(),
            "threads": os.environ.get("OMP_NUM_THREADS", "unset"), "warmup_steps": warm_steps,
            "steps": a.steps, "median_step_ms": med * 1e3, "min_step_ms": min(times) * 1e3,
            "tokens_per_s": toks / med,
            "median_cpu_ms": statistics.median(cpu) * 1e3, "tokens_per_cpu_s": toks / statistics.median(cpu),
            "overrides": a.overrides, **eng.memory()}


def table(r: dict) -> str:
    rows = [("model", f"{r['model']} d{r['d_model']} L{r['n_layers']} H{r['n_heads']} T{r['seq_len']} "
                      f"B{r['global_batch']} {r['dtype']} ({r['n_params']:,} params)"),
            ("threads", r["threads"]),
            ("steps", f"{r['steps']} timed after {r['warmup_steps']} warm-up"),
            ("step ms", f"median {r['median_step_ms']:.1f} | min {r['min_step_ms']:.1f} | "
                        f"CPU median {r['median_cpu_ms']:.1f}"),
            ("tokens/s", f"{r['tokens_per_s']:,.0f} (median)"),
            ("peak RSS", f"{r['peak_rss_bytes'] / 2**20:.0f} MiB")]
    return "\n".join(f"{k:<9} {v}" for k, v in rows)


def main(argv=None) -> int:
    a = parse(argv)
    ensure_threads(a.threads, __file__)
    r = run(a)
    print(table(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
