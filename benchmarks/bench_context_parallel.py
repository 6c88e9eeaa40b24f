"""Long sequences with context parallelism: the llama reference (byte vocabulary, d_model 256, 4 layers, 8 query
and 2 key/value heads, flash attention, float32) at seq 8,192 (and more with --seq), one sequence a step.

One process (cp 1) against cp 4 over `mpiexec -n 4`, ring and all-gather, for each the engine's counted
activation peak per rank next to the planner's prediction, the peak RSS of the largest rank, and the median
tokens/s; the cp 4 layouts run in one job, round after round (ring and all-gather interleaved), after warm-up.
For the ring also the exposed share of its communication: the time the ring drivers wait for their messages
(timed around every wait, the largest rank's), against the time the same messages take alone (the same
Isend/Irecv ring pattern and bytes without any compute, timed in the same job). A ratio waited / alone below
1 means part of the transfer hid behind the block compute (hidden = 1 - ratio); above 1, the waits also hold
time spent waiting for a slower peer's compute (ranks sharing cores), and nothing can be said of hiding.
Prints a Markdown table; not part of `make test`. --documents instead measures, without MPI, the cp ranks'
attention work over packed documents (query-key pairs under the document mask, from the documents alone) on
synthetic rows (windows of a stream of documents with exponential lengths): each document split head-tail over
the ranks (the engine's split) against each packed row split head-tail, busiest rank / mean.

    .venv/bin/python benchmarks/bench_context_parallel.py                  # seq 8192, 2 rounds
    .venv/bin/python benchmarks/bench_context_parallel.py --seq 8192 16384
    .venv/bin/python benchmarks/bench_context_parallel.py --documents --seq 4096 --cp 4 --mean 512 --rows 64
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
MODEL = ["model.kind=llama", "model.n_heads=8", "model.n_kv_heads=2", "model.attention=flash", "train.global_batch=1",
         "train.eval_every=0", "checkpoint.at_end=false"]


def sets(seq: int, cp: int, comm: str) -> list[str]:
    out = MODEL + [f"model.seq_len={seq}"]
    if cp > 1:
        out += ["strategy.context_parallel.enable=true", f"strategy.context_parallel.degree={cp}",
                f"strategy.context_parallel.comm={comm}"]
    return out


def alone_seconds(comm, nbytes: int, sends: int) -> float:
    """Seconds `sends` ring steps of one nbytes message each take with nothing else to do (to rank + 1, from
    rank - 1, the drivers' pattern)."""
    import numpy as np  # noqa: PLC0415

    from hpengine.dist.comm import waitall  # noqa: PLC0415
    n, r = comm.size, comm.rank
    a, b = np.zeros(nbytes // 4, np.float32), np.zeros(nbytes // 4, np.float32)
    comm.barrier()
    t = time.perf_counter()
    for _ in range(sends):
        waitall([comm.irecv(b, (r - 1) % n, 77), comm.isend(a, (r + 1) % n, 77)])
    return time.perf_counter() - t


def worker(a) -> None:
    from mpi4py import MPI  # noqa: PLC0415 - the driver runs without MPI

    import hpengine.strategies.context_parallel as ring  # noqa: PLC0415
    from hpengine.config.load import load_config  # noqa: PLC0415
    from hpengine.planner.model import for_rank  # noqa: PLC0415
    from hpengine.run.build import build  # noqa: PLC0415

    world = MPI.COMM_WORLD
    n = world.Get_size()
    waited = [0.0]
    raw = ring._wait

    def timed_wait(reqs):
        t = time.perf_counter()
        raw(reqs)
        waited[0] += time.perf_counter() - t
    ring._wait = timed_wait
    comms = ["ring", "allgather"] if n > 1 else ["ring"]
    runs = {c: [] for c in comms}
    for _ in range(a.rounds if n > 1 else 1):
        for c in comms:
            cfg = load_config(None, sets(a.seq[0], n, c))
            eng = build(cfg, world)
            for s in range(a.warmup):
                eng.train_step(s)
            waited[0], toks, t0 = 0.0, [], time.perf_counter()
            for s in range(a.warmup, a.warmup + a.steps):
                toks.append(eng.train_step(s)["tokens_per_s"])
            wall = time.perf_counter() - t0
            out = {"tokens_per_s": statistics.median(toks), "wait_s": waited[0] / a.steps, "step_s": wall / a.steps}
            mem = eng.memory()
            pred = for_rank(cfg, n, eng.mesh.coords)["memory"]
            out["act_mib"] = max(world.allgather(mem["activation_peak_bytes"])) / 2**20
            out["pred_act_mib"] = max(world.allgather(pred["activations"])) / 2**20
            out["rss_mib"] = max(world.allgather(mem["peak_rss_bytes"])) / 2**20
            if c == "ring" and n > 1:      # the same messages alone: per layer 2 (cp - 1) k/v steps + cp dk/dv
                mc = cfg.model
                kv = 2 * mc.seq_len // n * mc.n_kv_heads * (mc.d_model // mc.n_heads) * 4
                steps = mc.n_layers * (3 * n - 2)
                out["alone_s"] = max(world.allgather(alone_seconds(eng.mesh.comms["cp"], kv, steps)))
                out["wait_s"] = max(world.allgather(out["wait_s"]))
            runs[c].append(out)
            eng.mesh.free()
    if world.Get_rank() == 0:
        Path(a.json).write_text(json.dumps(runs))


def documents_lines(a) -> list[str]:
    """The per-document split's and the per-row head-tail split's work imbalance on synthetic packed rows."""
    import numpy as np  # noqa: PLC0415

    from hpengine.data.documents import window_documents  # noqa: PLC0415
    from hpengine.nn.context_split import document_work, imbalance, split_work  # noqa: PLC0415
    lines = [f"{datetime.date.today()}; `python {' '.join(sys.argv)}`; exponential document lengths, windows at "
             f"random starts, seeds {a.seeds}", "",
             "| seq | cp | mean length | rows | per document: busiest / mean (batch) | per row head-tail (batch) | "
             "per document (row, mean) | per row head-tail (row, mean) |", "|---|---|---|---|---|---|---|---|"]
    for seq in a.seq:
        for mean in a.mean:
            figs = []
            for seed in range(a.seeds):
                rng = np.random.default_rng(seed)
                lengths = np.maximum(1, rng.exponential(mean, a.rows * seq // mean * 4 + 16).astype(np.int64))
                offsets = np.concatenate([[0], np.cumsum(lengths)])
                seg, pos, _ = window_documents(offsets, rng.integers(0, offsets[-1] - seq - 1, a.rows), seq)
                per_row = [(imbalance(split_work(seg[i:i + 1], pos[i:i + 1], a.cp)),
                            imbalance(document_work(pos[i:i + 1], a.cp))) for i in range(a.rows)]
                figs.append((imbalance(split_work(seg, pos, a.cp)), imbalance(document_work(pos, a.cp)),
                             *np.mean(per_row, axis=0)))
            f = np.mean(figs, axis=0)
            lines.append(f"| {seq} | {a.cp} | {mean} | {a.rows} | {f[0]:.5f} | {f[1]:.3f} | {f[2]:.5f} | {f[3]:.3f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[8192])
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--documents", action="store_true", help="the cp work imbalance over packed documents (no MPI)")
    ap.add_argument("--mean", type=int, nargs="+", default=[512], help="--documents: mean document lengths")
    ap.add_argument("--rows", type=int, default=64, help="--documents: rows per batch")
    ap.add_argument("--seeds", type=int, default=4, help="--documents: batches averaged")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    if a.documents:
        print("\n".join(documents_lines(a)))
        return 0
    bin_ = Path(sys.executable).parent
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cpu = cpu_name()
    lines = [f"{datetime.date.today()}, {cpu}, {os.cpu_count()} cores; `python {' '.join(sys.argv)}`; {a.rounds} "
             f"rounds, {a.steps} timed steps after {a.warmup}, one BLAS thread per rank", "",
             "| seq | layout | tokens/s | activations MiB per rank (counted / planned) | peak RSS MiB | "
             "ring wait s per step | ring alone s per step | wait / alone |",
             "|---|---|---|---|---|---|---|---|"]
    for seq in a.seq:
        for n in (1, a.cp):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "r.json"
                subprocess.run([str(bin_ / "mpiexec"), "-n", str(n), sys.executable, str(Path(__file__).resolve()),
                                "--worker", "--seq", str(seq), "--rounds", str(a.rounds), "--steps", str(a.steps),
                                "--warmup", str(a.warmup), "--json", str(out)], check=True, env=env, cwd=tmp)
                runs = json.loads(out.read_text())
            for c, rs in runs.items():
                med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
                name = "one process (cp 1)" if n == 1 else f"cp {n} {c}"
                ring_cols = (f"{med('wait_s'):.2f} | {med('alone_s'):.2f} | {med('wait_s') / med('alone_s'):.2f}"
                             if "alone_s" in rs[0] else "– | – | –")
                lines.append(f"| {seq} | {name} | {med('tokens_per_s'):,.0f} | {med('act_mib'):.1f} / "
                             f"{med('pred_act_mib'):.1f} | {med('rss_mib'):.0f} | {ring_cols} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
