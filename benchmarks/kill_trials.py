"""How often a SIGKILLed rank is named: N trials of a tiny 4-rank `hpengine train` job under a real launcher,
each SIGKILLing one random rank (its pid from ranks.jsonl) once the job trains, then checking that stderr and
the run folder's failures.jsonl name that rank (rank, mesh coordinates, host, pid, SIGKILL). It also reports
the supervisor's memory (VmRSS, and PSS/USS from smaps_rollup: most of its pages are shared with its rank).

    .venv/bin/python benchmarks/kill_trials.py --launcher hydra --trials 15
    .venv/bin/python benchmarks/kill_trials.py --launcher openmpi --trials 15      # needs .venv-ompi
    .venv/bin/python benchmarks/kill_trials.py --launcher hydra --no-supervisor   # HPENGINE_SUPERVISOR=0

Exits 0 when every trial was named on both, else 1. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.kind=gpt", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "train.global_batch=4", "runtime.backend=numpy", "model.dtype=float64", "train.steps=100000",
        "strategy.data_parallel.enable=true"]


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launcher", choices=("hydra", "openmpi"), default="hydra")
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--venv", type=Path, help="the venv whose mpiexec/mpirun and python run the job (default: "
                   ".venv for hydra, .venv-ompi for openmpi, beside this repository)")
    p.add_argument("--no-supervisor", action="store_true", help="HPENGINE_SUPERVISOR=0: only the peers' monitor "
                   "names a dead rank (the fallback)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for a job to start and to end")
    return p.parse_args()


def _command(a) -> list[str]:
    venv = a.venv or ROOT / (".venv" if a.launcher == "hydra" else ".venv-ompi")
    if a.launcher == "hydra":
        return [str(venv / "bin" / "mpiexec"), "-n", str(a.ranks), str(venv / "bin" / "python")]
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [str(venv / "bin" / "mpirun"), *root, "--oversubscribe", "-n", str(a.ranks), str(venv / "bin" / "python")]


def _ranks(out: Path, n: int, timeout: float):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        try:
            rows = [json.loads(x) for x in (out / "ranks.jsonl").read_text().splitlines()]
            if len(rows) == n and (out / "metrics.jsonl").stat().st_size:
                return rows
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    return None


def _memory_kib(pid) -> dict:
    """VmRSS, Pss and USS (private pages) of a process, in KiB."""
    got = {}
    try:
        got["rss"] = next(int(x.split()[1]) for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if x.startswith("VmRSS:"))
        rollup = {x.split(":")[0]: int(x.split()[1]) for x in Path(f"/proc/{pid}/smaps_rollup").read_text()
                  .splitlines()[1:] if x.split()[-1] == "kB"}
        got["pss"], got["uss"] = rollup["Pss"], rollup["Private_Clean"] + rollup["Private_Dirty"]
    except (OSError, StopIteration, KeyError, ValueError):
        pass
    return got


def _kill_tree(p, rows) -> None:
    for pid in [p.pid] + [r.get(k) for r in rows or [] for k in ("pid", "supervisor_pid")]:
        try:
            if pid:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def trial(a, cmd, env, out: Path, victim: int) -> dict:
    sets = [x for s in [*TINY, f"train.out_dir={out}"] for x in ("--set", s)]
    p = subprocess.Popen(cmd + ["-m", "hpengine", "train", *sets], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=out.parent, start_new_session=True)
    rows = _ranks(out, a.ranks, a.timeout)
    if rows is None:
        _kill_tree(p, rows)
        return {"victim": victim, "error": f"no ranks.jsonl with {a.ranks} rows in {a.timeout:g} s: "
                + p.communicate()[1][-500:]}
    rec = rows[victim]
    mem = _memory_kib(rec["supervisor_pid"]) if rec.get("supervisor_pid") else {}
    os.kill(rec["pid"], signal.SIGKILL)
    t = time.monotonic()
    try:
        err = p.communicate(timeout=a.timeout)[1]
    except subprocess.TimeoutExpired:
        _kill_tree(p, rows)
        err = p.communicate()[1]
    took = time.monotonic() - t
    who = f"rank {victim} {rec['prefix']} (pid {rec['pid']} on {rec['host']})"
    lines = [x for x in err.splitlines() if x.startswith("hpengine: ") and who in x]
    on_stderr = any("SIGKILL" in x for x in lines) if not a.no_supervisor else bool(lines)
    try:
        entries = [json.loads(x) for x in (out / "failures.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        entries = []
    in_folder = any(e.get("rank") == victim and e.get("pid") == rec["pid"] and e.get("coords") == rec["coords"]
                    and e.get("host") == rec["host"] and (a.no_supervisor or e.get("signal") == "SIGKILL")
                    for e in entries)
    return {"victim": victim, "stderr": on_stderr, "folder": in_folder, "lines": len(lines), "end_s": took,
            "rc": p.returncode, **mem}


def main() -> int:
    a = _args()
    cmd = _command(a)
    if not Path(cmd[0]).exists():
        print(f"kill_trials: {cmd[0]} does not exist (--venv names the venv with the launcher)", file=sys.stderr)
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "HPENGINE_SUPERVISOR": "0" if a.no_supervisor else "1"}
    rng = random.Random(a.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="kill-trials-") as work:
        for i in range(a.trials):
            r = trial(a, cmd, env, Path(work) / f"t{i}", rng.randrange(a.ranks))
            results.append(r)
            print(f"trial {i + 1:>2}: rank {r['victim']} " + (r["error"] if "error" in r else
                  f"named on stderr: {'yes' if r['stderr'] else 'NO'}, in failures.jsonl: "
                  f"{'yes' if r['folder'] else 'NO'}, job ended {r['end_s']:.1f} s after the kill (status "
                  f"{r['rc']})"), flush=True)
    both = sum(bool(r.get("stderr") and r.get("folder")) for r in results)
    mode = "monitor only (HPENGINE_SUPERVISOR=0)" if a.no_supervisor else "supervisor"
    print(f"{a.launcher}, {mode}: named correctly on stderr and in the run folder in {both} of {a.trials} kills "
          f"(stderr {sum(bool(r.get('stderr')) for r in results)}, run folder "
          f"{sum(bool(r.get('folder')) for r in results)})")
    mem = [r for r in results if "uss" in r]
    if mem:
        print("supervisor memory (median over trials): VmRSS {:.1f} MiB, PSS {:.1f} MiB, USS {:.1f} MiB".format(
            *(statistics.median(r[k] for r in mem) / 1024 for k in ("rss", "pss", "uss"))))
    return 0 if both == a.trials else 1


if __name__ == "__main__":
    sys.exit(main())
