"""Measure this machine for the planner (`hpengine plan --calibrate`): matmul FLOP/s per process in each
precision, and point-to-point latency and bandwidth between ranks 0 and 1 (a memory copy on one
process); the result is a [cluster] table that `--cluster` reads back.
"""
from __future__ import annotations

import os
import time

GB = 1e9


def calibrate(gpus_per_node: int | None = None) -> str:
    """Measure this machine (matmul FLOP/s per process; ping-pong latency and bandwidth between ranks 0
    and 1 under mpiexec, else a memory copy) and return a [cluster] table for --cluster."""
    import numpy as np
    from mpi4py import MPI
    w = MPI.COMM_WORLD

    def rate(dtype, n=768):
        a = np.ones((n, n), dtype=dtype)
        return 2 * n**3 / _per_call(lambda: a @ a) / 1e12
    f32, f64, f16 = rate(np.float32), rate(np.float64), rate(np.float16, 256)
    a, b = np.ones(1 << 24), np.empty(1 << 24)     # one process: a memory copy stands in for the link
    lat, bw = _pingpong(w, np) if w.Get_size() > 1 else (1e-6, a.nbytes / _per_call(lambda: np.copyto(b, a)))
    gpn = gpus_per_node or (w.Get_size() if w.Get_size() > 1 else os.cpu_count() or 1)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB / gpn
    vals = {"nodes": 1, "gpus_per_node": gpn, "mem_gb": round(mem, 2), "intra_bw_gbs": round(bw / GB, 3),
            "inter_bw_gbs": round(bw / GB, 3), "intra_latency_us": round(lat * 1e6, 3),
            "inter_latency_us": round(lat * 1e6, 3), "tflops": round(max(f16, 1e-6), 6),
            "tflops_fp32": round(f32, 6), "tflops_fp64": round(f64, 6)}
    if w.Get_rank():
        return ""
    return "# measured by hpengine plan --calibrate\n[cluster]\n" + "".join(f"{k} = {v}\n" for k, v in vals.items())


def _pingpong(w, np, reps=20):
    """(one-way latency s, bandwidth B/s) between ranks 0 and 1."""
    out = []
    for n in (8, 1 << 24):
        buf = np.zeros(n, dtype=np.uint8)
        for i in range(-1, reps if n == 8 else 3):     # round -1 warms the connection up, untimed
            if i == 0:
                w.Barrier()
                t = time.perf_counter()
            if w.Get_rank() == 0:
                w.Send(buf, 1)
                w.Recv(buf, 1)
            elif w.Get_rank() == 1:
                w.Recv(buf, 0)
                w.Send(buf, 0)
        out.append((time.perf_counter() - t) / (2 * (reps if n == 8 else 3)))
    lat, big = w.bcast(out, root=0)
    return lat, (1 << 24) / max(big - lat, 1e-9)


def _per_call(fn, reps: int = 3) -> float:
    """Seconds per call of fn, after one untimed warm-up call."""
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps
