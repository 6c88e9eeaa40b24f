"""One benchmark command: the reference model (hpengine's built-in defaults) trained at 1, 2 and 4 ranks
under data parallel, sharding stages 1-3, pipeline (p 2 and 4, m 4 and 8), tensor parallel and tp x pp.
Each case is a fresh `mpiexec` job (the venv's) that warms up, then times steps; the cases are
interleaved across repeats and the table shows medians: tokens/s, peak RSS, bytes per step per
communicator, the measured pipeline bubble next to its theory, and the data-parallel gradient-sync wait
next to a raw MPI Allreduce of the same bytes. When a Python with PyTorch is given (--torch-python,
else $TORCH_PYTHON), the same model trained by PyTorch eager (torch_ref.py), DDP and FSDP2 over gloo
(torch_dist.py under torchrun) runs in the same rounds, each right after its hpengine peer, and the
table gives hpengine / torch. Not part of `make test`.

    .venv/bin/python benchmarks/bench_all.py                  # every case, 3 repeats
    .venv/bin/python benchmarks/bench_all.py --quick          # 5 cases (+ 2 torch), 1 repeat, few steps
    .venv/bin/python benchmarks/bench_all.py --only pp --repeats 5 --out /tmp/pp.md
    .venv/bin/python benchmarks/bench_all.py --only torch     # the PyTorch peers alone
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
DP = ["strategy.data_parallel.enable=true", "strategy.data_parallel.degree=-1"]


def sharding(stage):
    return ["strategy.sharding.enable=true", "strategy.sharding.degree=-1", f"strategy.sharding.stage={stage}"]


def pipeline(p, m):
    return ["strategy.pipeline.enable=true", f"strategy.pipeline.degree={p}", f"strategy.pipeline.micro_batches={m}",
            "strategy.pipeline.schedule='1f1b'"]


TP2 = ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=2"]
TP4 = ["strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=4"]
SP = ["strategy.tensor_parallel.sequence_parallel=true"]

# (name, ranks, overrides)
CASES = [("1 process", 1, []), ("dp", 2, DP), ("dp", 4, DP)] \
    + [(f"sharding stage {s}", n, sharding(s)) for s in (1, 2, 3) for n in (2, 4)] \
    + [(f"pp {p} m {m}", p, pipeline(p, m)) for p in (2, 4) for m in (4, 8)] \
    + [("tp 2", 2, TP2), ("tp 2 sp", 2, TP2 + SP), ("tp 4", 4, TP4), ("tp 4 sp", 4, TP4 + SP),
       ("tp 2 x pp 2 m 4", 4, TP2 + pipeline(2, 4)),
       ("tp 2 x pp 2 m 4 unsplit sends", 4, TP2 + pipeline(2, 4) + ["strategy.pipeline.scatter_gather=false"])]
QUICK = {("1 process", 1), ("dp", 2), ("sharding stage 2", 2), ("pp 2 m 4", 2), ("tp 2", 2)}

# PyTorch peers: (name, ranks, mode, the hpengine case it is paired with); each runs right after its peer
TORCH_CASES = [("torch eager", 1, "eager", ("1 process", 1))] \
    + [("torch DDP", n, "ddp", ("dp", n)) for n in (2, 4)] \
    + [("torch FSDP2", n, "fsdp2", ("sharding stage 3", n)) for n in (2, 4)]
TORCH_QUICK = {("torch eager", 1), ("torch DDP", 2)}
# hpengine config keys the torch scripts take as options; any other --set applies to hpengine alone
TORCH_ARGS = {"model.vocab_size": "--vocab", "model.seq_len": "--seq", "model.d_model": "--d-model",
              "model.n_layers": "--layers", "model.n_heads": "--heads", "train.global_batch": "--batch",
              "optim.lr": "--lr"}
HERE = Path(__file__).resolve().parent


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="5 cases, 1 repeat, 1 warm-up and 3 timed steps")
    p.add_argument("--repeats", type=int, default=None, help="rounds over all cases (default 3; quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per case (default 10; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; quick 1)")
    p.add_argument("--only", default=None, help="run the cases whose name contains this text")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every case, e.g. --set model.d_model=128 (repeatable)")
    p.add_argument("--mpiexec", default=None, help="mpiexec to use (default: the one beside this Python)")
    p.add_argument("--torch-python", default=None, metavar="PATH",
                   help="Python with torch for the PyTorch peers (default: $TORCH_PYTHON; neither given = "
                        "peers skipped)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch peers")
    p.add_argument("--timeout", type=float, default=600, help="seconds per case before it counts as failed")
    p.add_argument("--out", default=None, help="Markdown file for the table (default runs/bench/bench_all-DATE.md)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # internal: one case, JSON to this path
    a = p.parse_args(argv)
    q = a.quick
    a.repeats = a.repeats or (1 if q else 3)
    a.steps = a.steps or (3 if q else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if q else 3)
    return a


# ---- one case, inside mpiexec ----------------------------------------------------------------------

def worker(a) -> None:
    import resource

    import numpy as np
    from mpi4py import MPI

    from hpengine.config.load import load_config
    from hpengine.layout.schedules import bubble_fraction
    from hpengine.run.trace import Tracer, comms_of
    from hpengine.run.build import build

    cfg = load_config(None, ["train.eval_every=0", *a.overrides])
    eng = build(cfg)
    w = eng.world.c
    for s in range(a.warmup):
        eng.train_step(s)
    comms = comms_of(eng)
    for c in comms:
        c.reset_stats()
    eng.tracer, eng.pipe.busy_s, eng.pipe.wall_s = Tracer(), 0.0, 0.0
    w.Barrier()
    times = []
    for s in range(a.warmup, a.warmup + a.steps):
        t = time.perf_counter()
        eng.train_step(s)
        times.append(time.perf_counter() - t)
    slowest = np.array(times)
    w.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)           # a step lasts as long as its slowest rank
    nbytes = {}
    for c in comms:
        nbytes[c.name] = nbytes.get(c.name, 0) + sum(b for _, b in c.stats.values())
    rows = w.gather({"bytes": nbytes, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                     "act": eng.memory()["activation_peak_bytes"],
                     "bubble": 1 - eng.pipe.busy_s / eng.pipe.wall_s if eng.pipe.wall_s else None,
                     "sync_wait_s": eng.tracer.seconds["grad sync wait"] / a.steps,
                     "dp_bytes": sum(b for _, b in eng.mesh.comms["dp"].stats.values()) / a.steps}, root=0)
    raw = raw_allreduce_s(eng, rows[0]["dp_bytes"] if w.Get_rank() == 0 else None)
    if w.Get_rank() != 0:
        return
    tokens = cfg.train.global_batch * cfg.model.seq_len
    med = statistics.median(slowest)
    per_comm = {}
    for r in rows:
        for k, v in r["bytes"].items():
            per_comm[k] = per_comm.get(k, 0) + v / a.steps
    pc = cfg.strategy.pipeline
    bubbles = [r["bubble"] for r in rows if r["bubble"] is not None]
    out = {"tokens_per_s": tokens / med, "median_step_ms": med * 1e3, "peak_rss_bytes": max(r["rss"] for r in rows),
           "activation_peak_bytes": max(r["act"] for r in rows),
           "bytes_per_step": {k: v for k, v in per_comm.items() if v},
           "bubble": statistics.mean(bubbles) if pc.enable and bubbles else None,
           "bubble_theory": bubble_fraction(pc.schedule, pc.degree, pc.micro_batches) if pc.enable else None,
           "sync_wait_ms": statistics.mean(r["sync_wait_s"] for r in rows) * 1e3,
           "raw_allreduce_ms": raw * 1e3 if raw is not None else None, "n_params": eng.n_params()}
    Path(a.worker).write_text(json.dumps(out))


def raw_allreduce_s(eng, nbytes):
    """Median time of a plain MPI Allreduce of this many float32 bytes on the dp communicator (None
    without data parallelism): what the bucketed, overlapped gradient sync is compared with."""
    import numpy as np
    from mpi4py import MPI
    dp = eng.mesh.comms["dp"]
    nbytes = eng.world.c.bcast(nbytes, root=0)
    if dp.size == 1 or not nbytes:
        return None
    buf, times = np.ones(int(nbytes) // 4, dtype=np.float32), []
    for _ in range(5):
        dp.c.Barrier()
        t = time.perf_counter()
        dp.c.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---- the driver ---------------------------------------------------------------------------------

def run_case(a, mpiexec, name, n, overrides, tmp) -> dict:
    path = Path(tmp) / f"{len(os.listdir(tmp))}.json"
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()),
           "--worker", str(path), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    for o in [*overrides, *a.overrides]:
        cmd += ["--set", o]
    env = dict(os.environ, **{v: os.environ.get(v, "1") for v in THREADS})
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
        ok = p.returncode == 0 and path.exists()
        why = "" if ok else _why(p)
    except subprocess.TimeoutExpired:
        ok, why = False, f"timed out after {a.timeout:.0f} s"
    return _report(name, n, path if ok else None, why, t)


def _report(name, n, path, why, t) -> dict:
    print(f"  {name:<20} n={n}  " + (f"{json.loads(path.read_text())['tokens_per_s']:>9,.0f} tok/s" if path
                                     else f"FAILED: {why}") + f"  ({time.perf_counter() - t:.1f} s)", flush=True)
    return json.loads(path.read_text()) if path else {"error": why}


# ---- the PyTorch peers ------------------------------------------------------------------------------

def find_torch(a):
    """(python, torch version) or (None, why the peers are skipped)."""
    if a.no_torch:
        return None, "skipped (--no-torch)"
    py = a.torch_python or os.environ.get("TORCH_PYTHON")
    if not py:
        return None, ("skipped: no Python with torch (pass --torch-python PATH or set TORCH_PYTHON; "
                      "`pip install torch==2.13.0` in a separate venv)")
    try:
        p = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True,
                           timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"skipped: {py} does not run ({e})"
    if p.returncode:
        return None, f"skipped: `import torch` fails with {py}: {_why(p)}"
    return py, p.stdout.strip()


def torch_model_args(a):
    """torch_ref.py / torch_dist.py options for the --set overrides that change the model, and the rest."""
    args, rest = [], []
    for o in a.overrides:
        k, _, v = o.partition("=")
        if k.strip() in TORCH_ARGS:
            args += [TORCH_ARGS[k.strip()], v.strip().strip("'\"")]
        else:
            rest.append(o)
    return args, rest


def run_torch(a, py, name, n, mode, tmp) -> dict:
    path = Path(tmp) / f"{len(os.listdir(tmp))}.json"
    if mode == "eager":                     # torch_ref.py warms up by time: about as many steps as hpengine
        cmd = [py, str(HERE / "torch_ref.py"), "--warmup-s", f"{0.35 * a.warmup:g}"]
    else:
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               str(HERE / "torch_dist.py"), "--mode", mode, "--warmup", str(a.warmup)]
    cmd += ["--steps", str(a.steps), "--threads", "1", "--json", str(path), *torch_model_args(a)[0]]
    env = dict(os.environ, **{v: "1" for v in THREADS})
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
        ok = p.returncode == 0 and path.exists()
        why = ""
        if not ok:                          # torch_dist.py writes each rank's exception; torchrun's report hides it
            errs = sorted(Path(tmp).glob(path.name + ".rank*.err"))
            why = errs[0].read_text().strip() if errs else _why_torchrun(p)
    except subprocess.TimeoutExpired:
        ok, why = False, f"timed out after {a.timeout:.0f} s"
    return _report(name, n, path if ok else None, why, t)


def _why(p) -> str:
    """The exception line of a failed case (not mpiexec's abort notice)."""
    lines = [ln.strip() for ln in p.stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ("Error" in ln or "error:" in ln) and not ln.startswith("Abort(")]
    return (errs or lines or [f"exit status {p.returncode}"])[-1]


def _why_torchrun(p) -> str:
    """A failed torchrun job that left no exception behind (a rank crashed): the crash and its exit code."""
    if "Root Cause" not in p.stderr:
        return _why(p)
    lines = [ln.strip() for ln in p.stderr.split("Root Cause")[-1].splitlines()]
    info = [ln for ln in lines if ln.startswith(("rank ", "exitcode"))]
    crash = [ln.strip() for ln in p.stderr.splitlines() if ln.startswith(("terminate called", "Fatal Python"))]
    return "; ".join(crash[:1] + [" ".join(ln.split()) for ln in info])


def summarize(results: dict, pairs: dict) -> list[dict]:
    rows = []
    for (name, n), runs in results.items():
        torch = (name, n) in pairs
        good = [r for r in runs if "error" not in r]
        if not good:
            rows.append({"case": name, "ranks": n, "torch": torch, "error": runs[-1]["error"]})
            continue
        med = lambda k: statistics.median(r[k] for r in good) if good[0].get(k) is not None else None  # noqa: E731
        rows.append({"case": name, "ranks": n, "torch": torch, "pair": pairs.get((name, n)), "runs": len(good),
                     "tokens_per_s": med("tokens_per_s"), "peak_rss_mib": med("peak_rss_bytes") / 2**20,
                     "act_mib": (med("activation_peak_bytes") or 0) / 2**20,
                     "bytes_per_step": good[0].get("bytes_per_step", {}), "bubble": med("bubble"),
                     "bubble_theory": good[0].get("bubble_theory"), "sync_wait_ms": med("sync_wait_ms"),
                     "raw_allreduce_ms": med("raw_allreduce_ms")})
    return rows


def markdown(rows, a, header, torch_note=None) -> str:
    ok = {(r["case"], r["ranks"]): r for r in rows if "error" not in r}
    base = {t: next((r["tokens_per_s"] for r in rows if r["ranks"] == 1 and r["torch"] == t and "error" not in r),
                    None) for t in (False, True)}
    out = [header, "", "| case | ranks | tokens/s (median) | vs 1 process | hpengine / torch | peak RSS / activations MiB (max rank) "
           "| MiB/step per communicator (all ranks) | pipeline bubble measured / theory | dp sync wait / raw "
           "Allreduce, ms |", "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['case']} | {r['ranks']} | failed: {r['error'][:80]} | | | | | | |")
            continue
        comm = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(r["bytes_per_step"].items())) or "-"
        bub = f"{r['bubble']:.2f} / {r['bubble_theory']:.2f}" if r["bubble"] is not None else "-"
        sync = (f"{r['sync_wait_ms']:.1f} / {r['raw_allreduce_ms']:.1f}" if r["raw_allreduce_ms"] is not None
                else "-")
        b = base[r["torch"]]
        ratio = f"{r['tokens_per_s'] / b:.2f}x" if b else "-"
        peer = ok.get(r["pair"]) if r["torch"] else None
        vs = f"{peer['tokens_per_s'] / r['tokens_per_s']:.2f}x" if peer else "-"
        out.append(f"| {r['case']} | {r['ranks']} | {r['tokens_per_s']:,.0f} | {ratio} | {vs} | "
                   f"{r['peak_rss_mib']:.0f} / {r['act_mib']:.0f} | {comm} | {bub} | {sync} |")
    out += ["", f"Medians of {a.repeats} interleaved repeat(s), each {a.steps} timed steps after {a.warmup} warm-up; "
            "a step lasts as long as its slowest rank. Bytes are what each rank hands to MPI (comm stats), "
            "summed over ranks. The dp sync wait is the part of the gradient all-reduce that backward did not "
            "hide; the raw Allreduce moves the same bytes in one call."]
    if torch_note:
        out += ["", torch_note]
    failed = [r for r in rows if r["torch"] and "error" in r]
    out += [f"- {r['case']} {r['ranks']} failed: `{r['error']}`" for r in failed]
    return "\n".join(out) + "\n"


def torch_note(a, py, version) -> str:
    if not py:
        return f"PyTorch peers: {version}"
    _, unmapped = torch_model_args(a)
    return (f"PyTorch peers (torch {version}, {py}; not an hpengine dependency): the same model and optimizer "
            "step (torch_ref.py: explicit attention, `clip_grad_norm_`, `AdamW(fused=False)`), one thread per "
            "rank, the global batch split across ranks. *torch eager* is torch_ref.py in one process (warm-up "
            f"by time, {0.35 * a.warmup:g} s); *torch DDP* (`DistributedDataParallel`) and *torch FSDP2* "
            "(`fully_shard` per block and on the root, reshard after forward) are torch_dist.py over gloo under "
            "`torchrun --standalone`, each timed step started after a barrier. Each runs right after its hpengine "
            "peer; *hpengine / torch* divides the peer's tokens/s by the torch row's: eager vs 1 process, DDP N vs "
            "dp N, FSDP2 N vs sharding stage 3 N. On torch rows *vs 1 process* is against torch eager."
            + (f" Not applied to the torch peers: {', '.join(unmapped)}." if unmapped else ""))


def main(argv=None) -> int:
    a = parse(argv)
    if a.worker:
        worker(a)
        return 0
    mpiexec = a.mpiexec or str(Path(sys.executable).parent / "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec")
    if not mpiexec:
        print("bench_all: no mpiexec beside this Python nor on PATH; pass --mpiexec", file=sys.stderr)
        return 2
    cases = [c for c in CASES if (not a.quick or (c[0], c[1]) in QUICK) and (not a.only or a.only in c[0])]
    py, version = find_torch(a)
    tcases = [c for c in TORCH_CASES if py and (not a.quick or (c[0], c[1]) in TORCH_QUICK)
              and (not a.only or a.only in c[0])]
    if not cases and not tcases:
        print(f"bench_all: no case matches --only {a.only!r}", file=sys.stderr)
        return 2
    print(f"PyTorch peers: torch {version} ({py})" if py else f"PyTorch peers: {version}", flush=True)
    # every torch case right after its hpengine peer (the same machine state), unpaired ones at the end
    order = []
    for name, n, over in cases:
        order.append((name, n, "hpengine", over))
        order += [(tn, tr, mode, None) for tn, tr, mode, pair in tcases if pair == (name, n)]
    order += [(tn, tr, mode, None) for tn, tr, mode, pair in tcases if pair not in {(c[0], c[1]) for c in cases}]
    pairs = {(tn, tr): pair for tn, tr, _, pair in tcases}
    results = {(name, n): [] for name, n, _, _ in order}
    with tempfile.TemporaryDirectory(prefix="hpengine-bench-") as tmp:
        for rep in range(a.repeats):
            print(f"round {rep + 1} of {a.repeats}", flush=True)
            for name, n, kind, over in order:
                results[(name, n)].append(run_case(a, mpiexec, name, n, over, tmp) if kind == "hpengine"
                                          else run_torch(a, py, name, n, kind, tmp))
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    header = (f"### hpengine benchmarks, {stamp}, {platform.node()} ({os.cpu_count()} CPUs, "
              f"{platform.machine()}, Python {platform.python_version()})\n\nReference model: hpengine's built-in "
              f"defaults{' with ' + ', '.join(a.overrides) if a.overrides else ''} (GPT, d_model 256, 4 layers, "
              f"seq 128, global batch 8 = 1,024 tokens/step, float32); one BLAS thread per rank.")
    text = markdown(summarize(results, pairs), a, header, torch_note(a, py, version))
    print("\n" + text)
    out = Path(a.out) if a.out else ROOT / "runs" / "bench" / f"bench_all-{time.strftime('%Y%m%d-%H%M%S')}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"saved {out}")
    return 0 if all("error" not in r for runs in results.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
