"""Asynchronous checkpoints against synchronous ones, one process, a GPT large enough that a synchronous save
takes seconds (d_model 1024, 12 layers, float32: 1.8 GB of parameters and Adam moments on disk).

1. The training-visible time of one save: a synchronous `save_state` (from the call to the published
   manifest) against an asynchronous one (the call, the fence before the next update, and the publish at
   the step boundary where every writer has finished: `Saver.visible_s`), each followed by training steps,
   the two interleaved round after round after a warm-up save.
2. Tokens/s of `hpengine train` runs saving every 10 steps (asynchronous, and synchronous for reference)
   against a run that never saves, the runs interleaved: the tokens of steps 2..N over the wall time from the
   end of step 1 to the end of step N (metrics.jsonl's elapsed_s), which holds what the saves at steps 10,
   20, 30 cost training (the last step's save comes after it, in every run alike), median over the repeats.
Prints a Markdown table; not part of `make test`. The folder given with --dir (default: a temporary folder)
must have room for two checkpoints (~4 GB).

    .venv/bin/python benchmarks/bench_async_checkpoint.py                 # 3 rounds of each
    .venv/bin/python benchmarks/bench_async_checkpoint.py --rounds 5 --steps 41
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
TOKENS_PER_STEP = 1 * 32         # train.global_batch x model.seq_len below
MODEL = ["model.kind=gpt", "model.d_model=1024", "model.n_layers=12", "model.n_heads=16", "model.seq_len=32",
         "model.dtype=float32", "train.global_batch=1", "train.eval_every=0", "train.log_every=1000",
         "runtime.backend=numpy", "checkpoint.every_minutes=0", "checkpoint.at_end=false", "checkpoint.keep=1"]


def visible_times(rounds: int, folder: Path) -> list[tuple[float, float, float]]:
    """(synchronous save s, asynchronous visible s, asynchronous written s) per round."""
    from hpengine.checkpoint import background  # noqa: PLC0415 - the driver part runs without MPI
    from hpengine.config.load import load_config  # noqa: PLC0415
    from hpengine.run import launch  # noqa: PLC0415
    from hpengine.run.build import build  # noqa: PLC0415
    from hpengine.run.train import save_state  # noqa: PLC0415
    eng = build(load_config(None, MODEL))
    log = logging.getLogger("bench")
    saver = background.Saver(eng.world, eng.tracer, log)
    step, out = 0, []

    def train(n):
        nonlocal step
        for _ in range(n):
            eng.train_step(step)
            step += 1
            _, _, writer = launch.step_boundary(None, False, saver.state())
            saver.settle(writer)
    for r in range(rounds + 1):              # round 0 warms the page cache and the allocator up
        eng.fence_updates(None)
        t = time.perf_counter()
        save_state(eng, folder / "sync", step, keep=1)
        sync_s = time.perf_counter() - t
        train(2)
        eng.fence_updates(saver.fence)
        t = time.perf_counter()
        save_state(eng, folder / "async", step, keep=1, saver=saver)
        while saver.job is not None:         # steps until the boundary that publishes it
            train(1)
        written = time.perf_counter() - t
        if r:
            out.append((sync_s, saver.visible_s, written))
            print(f"round {r}: sync {sync_s:.2f} s, async visible {saver.visible_s:.3f} s "
                  f"(written in {written:.2f} s, steps meanwhile)", flush=True)
    return out


def run_tps(folder: Path, steps: int, every: int, asynchronous: bool) -> float:
    out = folder / f"run-{every}-{int(asynchronous)}-{time.monotonic_ns()}"
    sets = [*MODEL, f"train.steps={steps}", f"checkpoint.every={every}", f"checkpoint.async={str(asynchronous).lower()}",
            f"train.out_dir={out}"]
    cmd = [sys.executable, "-m", "hpengine", "train", *[x for s in sets for x in ("--set", s)]]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out, ignore_errors=True)
    tokens = (rows[-1]["step"] - rows[0]["step"]) * TOKENS_PER_STEP     # wall time from step 1's end to the last's
    return tokens / (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=31, help="steps of each tokens/s run")
    p.add_argument("--dir", default=None, help="folder for the checkpoints (default: a temporary folder)")
    a = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hpengine-bench-ckpt-", dir=a.dir))
    try:
        vis = visible_times(a.rounds, folder)
        runs = {"never saves": [], "async, every 10": [], "sync, every 10": []}
        for r in range(a.rounds):
            for name, every, asy in (("never saves", 0, True), ("async, every 10", 10, True), ("sync, every 10", 10, False)):
                runs[name].append(run_tps(folder, a.steps, every, asy))
                print(f"round {r + 1}: {name}: {runs[name][-1]:,.1f} tok/s", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    sync_s, vis_s, wr_s = (statistics.median(x[i] for x in vis) for i in range(3))
    base = statistics.median(runs["never saves"])
    print(f"\n{datetime.date.today()}, {cpu_name()}, one process, "
          f"{a.rounds} interleaved rounds, medians\n")
    print("| measure | value |\n|---|---|")
    print(f"| synchronous save, training waits | {sync_s:.2f} s |")
    print(f"| asynchronous save, training waits | {vis_s:.3f} s ({vis_s / sync_s:.1%} of the synchronous save) |")
    print(f"| asynchronous save, written in the background in | {wr_s:.2f} s |")
    for name, xs in runs.items():
        print(f"| tokens/s, {name} ({a.steps} steps) | {statistics.median(xs):,.1f} "
              f"({statistics.median(xs) / base:.3f} x never saves) |")


if __name__ == "__main__":
    main()
