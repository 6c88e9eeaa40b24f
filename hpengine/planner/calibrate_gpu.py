"""`hpengine plan --calibrate` on a GPU (CuPy, through backend.py): measure the figures of the planner's
GPU compute model (planner/gpu.py) on this device, and under mpiexec the link between GPUs, and print them
as a [cluster] table. The measuring needs a GPU; the fitting (fit_device) takes the measured (size, seconds)
tuples only, so it is tested without one.
"""
from __future__ import annotations

import functools
import math
import time

from mpi4py import MPI

from hpengine.device.backend import BackendError, cupy_module, cupy_usable, make_backend
from hpengine.dist.comm import Comm
from hpengine.dist.topology import node_ranks
from hpengine.planner.gpu import fit_bandwidth, fit_gemm, fit_line
from hpengine.planner.peaks import table_peak

ROUNDS = 5
# (M, K, N): squares from launch-bound to compute-bound, and a transformer layer's shapes (tokens x C x 3C,
# tokens x 4C x C) at two widths
GEMM_SHAPES = ((512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
               (4096, 2048, 6144), (4096, 8192, 2048), (8192, 4096, 12288), (8192, 16384, 4096))
COPY_ELEMENTS = (1 << 24, 1 << 26, 1 << 28)          # float32: 64 MiB to 1 GiB per operand
LAUNCH_CALLS = (200, 2000)
KEYS = ("gpus_per_node", "mem_gb", "tflops", "tflops_fp32", "tflops_fp64", "gemm_half_dim", "gemm_eff_max",
        "mem_bw_gbs", "launch_us")
LINK_KEYS = ("intra_bw_gbs", "intra_latency_us")
LINK_ELEMENTS = (1 << 18, 1 << 24)                  # float32: 1 MiB and 64 MiB


def fit_device(gemm, copies, launches, peak: float) -> dict:
    """The [cluster] figures from measurements: gemm = [((M, K, N), seconds)] at `peak` FLOP/s, copies =
    [(bytes moved, seconds)], launches = [(calls back to back, seconds)]."""
    launch_s = max(fit_line(launches)[1], 0.0)
    half, eff_max = fit_gemm(gemm, peak, launch_s)
    return {"gemm_half_dim": half, "gemm_eff_max": eff_max, "mem_bw_gbs": fit_bandwidth(copies) / 1e9,
            "launch_us": launch_s * 1e6}


def table(vals: dict, device: str) -> str:
    links = all(k in vals for k in LINK_KEYS)
    lines = [f"# measured by hpengine plan --calibrate --device gpu on {device}: GEMM efficiency, memory "
             "bandwidth and kernel launch" + ("; the intra-node link by device-buffer allreduces" if links else
                                             "; links not measured (one rank; copy them from clusters/*.toml)"),
             "[cluster]"]
    for k in KEYS + (LINK_KEYS if links else ()):
        v = vals[k]
        lines.append(f"{k} = {v if isinstance(v, int) else f'{v:.4g}'}")
    return "\n".join(lines) + "\n"


# Measures the rate of GEMMs of
# several shapes, fitted to eff(d) = eff_max · d / (d + d_half) of the datasheet peak (peaks.PEAK_TFLOPS);
# the memory bandwidth of large element-wise kernels (a copy and an add, by the bytes they move); and the
# cost of a kernel call, from tiny kernels back to back (what the host spends to launch one, as the engine
# launches them).
def calibrate_gpu(gpus_per_node: int | None = None) -> str:
    """Measure rank 0's GPU (the others wait) and, with several ranks, the link between the ranks' GPUs;
    return the [cluster] table (on rank 0; "" elsewhere)."""

    if not cupy_usable():
        raise BackendError("plan --calibrate --device gpu: no usable CUDA device (CuPy not installed or no GPU "
                           "visible); use --device cpu")
    w = MPI.COMM_WORLD
    links = _links(w) if w.Get_size() > 1 else {}
    out = _measure(gpus_per_node, links) if w.Get_rank() == 0 else ""
    w.Barrier()
    return out


# Under `mpiexec -n N` with N > 1 (one GPU a rank), the link between them as the
# engine uses it: allreduces of device buffers through comm.Comm (host-staged or CUDA-aware, whichever the
# engine would pick), their latency from a one-element call and their bandwidth from 1 MiB to 64 MiB
# (link_figures). Those are intra-node figures when the ranks share a node; the inter-node ones still come
# from a clusters/*.toml file or the flags.
def link_figures(w, comm, xp, elements=LINK_ELEMENTS, reps: int = 5) -> dict:
    """intra_bw_gbs and intra_latency_us of allreduces through `comm` (a comm.Comm over w) on float32
    arrays of module xp: the slowest rank's best time per call, a one-element call for the latency (per
    round of recursive doubling) and the growth from the smaller to the larger size for the bandwidth over
    the 2(n-1)/n of the bytes a ring moves (the planner's alpha-beta model)."""
    n = w.Get_size()

    def per_call(size) -> float:
        x = xp.ones(size, dtype=xp.float32)
        comm.allreduce_(x)                          # warm-up (and the staging buffer's first allocation)
        best = math.inf
        for _ in range(ROUNDS):
            w.Barrier()
            t = time.perf_counter()
            for _ in range(reps):
                comm.allreduce_(x)
            best = min(best, (time.perf_counter() - t) / reps)
        return w.allreduce(best, op=MPI.MAX)
    small, big = (per_call(s) for s in elements)
    lat = per_call(1) / max(1, math.ceil(math.log2(n)))
    moved = 2 * (n - 1) / n * 4 * (elements[1] - elements[0])
    return {"intra_bw_gbs": moved / max(big - small, 1e-9) / 1e9, "intra_latency_us": lat * 1e6}


def _links(w) -> dict:
    """link_figures on this rank's GPU (node-local rank modulo the devices), as the engine would reach MPI."""
    local, size = node_ranks(w)
    be = make_backend("cupy", "float32", local, size, share_devices=True)
    return link_figures(w, Comm(w, "calibrate", be), be.xp)


def _measure(gpus_per_node, links=None) -> str:
    cp = cupy_module()
    dev = cp.cuda.Device(0)
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    peaks = {p: table_peak(name, p) for p in ("16bit", "fp32", "fp64")}
    gemm = [(s, _gemm_s(cp, dev, *s, cp.float16)) for s in GEMM_SHAPES]
    big = {dt: 2 * 8192**3 / _gemm_s(cp, dev, 8192, 8192, 8192, dt) / 1e12 for dt in (cp.float32, cp.float64)}
    peak16 = peaks["16bit"] or max(2 * m * k * n / t for (m, k, n), t in gemm) / 1e12
    try:
        vals = fit_device(gemm, _copies(cp, dev), _launches(cp, dev), peak16 * 1e12)
    except ValueError as e:            # timings too noisy to fit (another job on the device)
        raise BackendError(f"plan --calibrate --device gpu on {name}: {e}; run it again on an idle device") from None
    vals.update(gpus_per_node=gpus_per_node or cp.cuda.runtime.getDeviceCount(),
                mem_gb=cp.cuda.runtime.memGetInfo()[1] / 1e9, tflops=peak16,
                tflops_fp32=peaks["fp32"] or big[cp.float32] / vals["gemm_eff_max"],
                tflops_fp64=peaks["fp64"] or big[cp.float64] / vals["gemm_eff_max"], **(links or {}))
    return table(vals, name)


def _events(cp, dev, fn, reps: int) -> float:
    """Seconds per call of fn on the device (CUDA events; the best of ROUNDS rounds, after a warm-up)."""
    fn()
    dev.synchronize()
    best = math.inf
    for _ in range(ROUNDS):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(a, b) * 1e-3 / reps)
    return best


def _gemm_s(cp, dev, m, k, n, dtype) -> float:
    x, y = cp.ones((m, k), dtype=dtype), cp.ones((k, n), dtype=dtype)
    z = cp.empty((m, n), dtype=dtype)
    return _events(cp, dev, lambda: cp.matmul(x, y, out=z), 3)


def _copies(cp, dev) -> list:
    """(bytes moved, seconds) of a copy (reads and writes n) and an add (reads 2n, writes n) in float32."""
    out = []
    for n in COPY_ELEMENTS:
        x, y, z = (cp.ones(n, dtype=cp.float32) for _ in range(3))
        out.append((8 * n, _events(cp, dev, functools.partial(cp.copyto, y, x), 3)))
        out.append((12 * n, _events(cp, dev, functools.partial(cp.add, x, y, out=z), 3)))
        x = y = z = None                 # freed before the next size is allocated
    return out


def _launches(cp, dev) -> list:
    """(calls, seconds) of tiny kernels back to back, timed on the host: the per-call cost is the slope."""
    x = cp.zeros(1, dtype=cp.float32)
    out = []
    for calls in LAUNCH_CALLS:
        best = math.inf
        for _ in range(ROUNDS):
            dev.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                cp.add(x, 1, out=x)
            dev.synchronize()
            best = min(best, time.perf_counter() - t)
        out.append((calls, best))
    return out
