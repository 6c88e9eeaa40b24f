"""How close one process's optimizer step comes to its GEMM limit: the step's own matrix products, timed alone.

Records every GEMM one optimizer step issues (shapes, strides, accumulate or write), by routing the engine's
passes through the one place all its products meet (nn/bf16_gemm.matmul, the layers handed a bfloat16-operand policy
that stores nothing in bfloat16, with a recorder that multiplies in plain float32, so the values and the calls are
those of the float32 step). It then times the step as
bench_core.py does, and the recorded products replayed back to back on operands of the same layouts with the
same BLAS. The limit is the step's tokens over the replay's time: what the step would reach if everything that
is not a GEMM took no time. A second, stricter limit runs the step's GEMM FLOPs at the BLAS's peak rate (a
square float32 GEMM of --peak-n): its gap to the first is the GEMMs' shapes (attention's small batched products
above all), not the passes around them. Rounds interleave step, replay and peak; medians are quoted, and the
BLAS kernel that ran (threadpoolctl).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gemm_limit.py --repeats 5
    .venv/bin/python benchmarks/bench_gemm_limit.py --set model.kind=llama --set model.n_heads=8 --set model.n_kv_heads=2
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

from _machine import cpu_name  # noqa: E402 - benchmarks/ is sys.path[0]
from bench_core import warm_engine  # noqa: E402
from _threads import ensure_threads  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds of step and replay (default 5)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    p.add_argument("--warmup-s", type=float, default=5.0, help="untimed warm-up seconds (default 5)")
    p.add_argument("--threads", type=int, default=1, help="BLAS/OpenMP threads (default 1; 0 = leave)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override passed to hpengine (repeatable)")
    p.add_argument("--peak-n", type=int, default=1024, help="size of the square GEMM timed for the peak rate")
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    return p.parse_args(argv)


class Recorder:
    """Stands in for bf16_gemm.matmul during one step: the float32 products the CPU path makes (the
same calls as attention's and linear's float32 branches), each call's layout noted."""

    def __init__(self):
        self.calls = []

    def matmul(self, xp, a, b, out=None, accumulate=False, held=None):
        self.calls.append((_layout(a), _layout(b), None if out is None else _layout(out), bool(accumulate)))
        if out is None:
            return a @ b
        if accumulate:
            out += a @ b
            return out
        return xp.matmul(a, b, out=out)

    def flops(self) -> int:
        return sum(2 * _rows(a) * a[0][-1] * b[0][-1] for a, b, _, _ in self.calls)


def _layout(x):
    return (tuple(x.shape), tuple(x.strides), x.dtype.str)


def _rows(lay) -> int:
    n = 1
    for s in lay[0][:-1]:
        n *= s
    return n


def _operand(np, lay):
    """A fresh array with lay's shape, strides and dtype (inside a buffer large enough for the strides)."""
    shape, strides, dt = lay
    item = np.dtype(dt).itemsize
    span = 1 + sum((n - 1) * abs(s) // item for n, s in zip(shape, strides) if n)
    base = np.random.default_rng(0).standard_normal(span).astype(dt)
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides)


def replay_plan(np, calls):
    """(a, b, out, accumulate) operands for every recorded call; outputs as the step had them (fresh
    contiguous ones where the step let the product allocate)."""
    plan = []
    for la, lb, lo, acc in calls:
        a, b = _operand(np, la), _operand(np, lb)
        out = np.empty(la[0][:-1] + lb[0][-1:], dtype=la[2]) if lo is None else _operand(np, lo).copy()
        plan.append((a, b, out if lo is not None else None, acc))
    return plan


def replay(np, plan) -> float:
    t0 = time.perf_counter()
    for a, b, out, acc in plan:
        if out is None:
            a @ b
        elif acc:
            out += a @ b
        else:
            np.matmul(a, b, out=out)
    return time.perf_counter() - t0


@contextlib.contextmanager
def recording(rec, eng):
    import dataclasses  # noqa: PLC0415

    from hpengine.nn import Numerics, bf16_gemm  # noqa: PLC0415 - after the thread variables are set

    saved = bf16_gemm.matmul, eng.ctx
    # every GEMM through bf16_gemm.matmul (the recorder), no output stored in bfloat16: the float32 step's values
    bf16_gemm.matmul, eng.ctx = rec.matmul, dataclasses.replace(eng.ctx, num=Numerics(bf16=True).float32_out)
    try:
        yield
    finally:
        bf16_gemm.matmul, eng.ctx = saved


def run(a) -> dict:
    import numpy as np  # noqa: PLC0415
    from threadpoolctl import threadpool_info  # noqa: PLC0415

    cfg, eng, toks, step = warm_engine(a.overrides, a.warmup_s)
    rec = Recorder()
    with recording(rec, eng):
        eng.train_step(step)
    step += 1
    plan = replay_plan(np, rec.calls)
    for _ in range(3):
        replay(np, plan)
    sq = [_operand(np, ((a.peak_n, a.peak_n), (4 * a.peak_n, 4), "<f4")) for _ in range(3)]
    steps, gemms, peaks = [], [], []
    for _ in range(a.repeats):
        for _ in range(a.steps):
            t0 = time.perf_counter()
            eng.train_step(step)
            steps.append(time.perf_counter() - t0)
            step += 1
        gemms.extend(replay(np, plan) for _ in range(a.steps))
        peaks.extend(replay(np, [(sq[0], sq[1], sq[2], False)]) for _ in range(a.steps))
    blas = [{k: d.get(k) for k in ("internal_api", "architecture", "num_threads", "version")}
            for d in threadpool_info() if d.get("user_api") == "blas"]
    step_s, gemm_s = statistics.median(steps), statistics.median(gemms)
    peak = 2 * a.peak_n ** 3 / statistics.median(peaks)
    peak_s = rec.flops() / peak
    return {"model": f"{cfg.model.kind} d{cfg.model.d_model} L{cfg.model.n_layers} T{cfg.model.seq_len} "
                     f"B{cfg.train.global_batch}", "n_params": eng.n_params(), "cpu": cpu_name(), "blas": blas,
            "gemm_calls": len(rec.calls), "gemm_gflop": rec.flops() / 1e9,
            "step_ms": step_s * 1e3, "gemm_ms": gemm_s * 1e3, "tokens_per_s": toks / step_s,
            "limit_tokens_per_s": toks / gemm_s, "fraction_of_limit": gemm_s / step_s,
            "gemm_gflops": rec.flops() / gemm_s / 1e9, "peak_gflops": peak / 1e9,
            "peak_limit_tokens_per_s": toks / peak_s, "fraction_of_peak_limit": peak_s / step_s,
            "overrides": a.overrides}


def main(argv=None) -> int:
    a = parse(argv)
    ensure_threads(a.threads, __file__)
    r = run(a)
    kern = ", ".join(f"{b['internal_api']} {b['version']} {b['architecture']} kernels, {b['num_threads']} threads"
                     for b in r["blas"])
    print(f"{r['model']} ({r['n_params']:,} params) on {r['cpu']}; BLAS: {kern}")
    print(f"GEMMs per step: {r['gemm_calls']} calls, {r['gemm_gflop']:.3f} GFLOP, alone {r['gemm_ms']:.1f} ms "
          f"({r['gemm_gflops']:.1f} GFLOP/s)")
    print(f"step: {r['step_ms']:.1f} ms = {r['tokens_per_s']:,.0f} tok/s; limit {r['limit_tokens_per_s']:,.0f} tok/s; "
          f"step at {100 * r['fraction_of_limit']:.1f} % of its GEMM limit (medians of {a.repeats} x {a.steps})")
    print(f"peak: {r['peak_gflops']:.1f} GFLOP/s (square {a.peak_n}); limit at peak {r['peak_limit_tokens_per_s']:,.0f} "
          f"tok/s; step at {100 * r['fraction_of_peak_limit']:.1f} % of it")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
