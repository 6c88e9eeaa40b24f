"""Measure this machine for the planner (`hpengine plan --calibrate`, run under the `mpiexec -n` of the
jobs it plans): the costs of the primitives a step is made of, never a step itself, as a [cluster] table
that `--cluster` reads back. Also the CPU peak the training progress line's MFU is measured against
(measured_peak: the best GEMM rate this machine has shown).
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.device.backend import cupy_usable, keep_heap
from hpengine.device.threads import pool_size
from hpengine.dist.comm import Comm, testall, waitall
from hpengine.layout.cache import cache_nbytes
from hpengine.layout.resolve import resolve
from hpengine.models import LOCAL, build_model
from hpengine.optim import AdamW, sum_of_squares
from hpengine.params.buffers import FlatBuffer, Layout as Offsets, ParamSpec, Range
from hpengine.planner.calibrate_gpu import calibrate_gpu
from hpengine.planner.memory import block_activations
from hpengine.planner.model import matmul_flops
from hpengine.planner.peaks import best_peak, cached_peak, cpu_bound, peak_key

GB = 1e9
ROUNDS = 5                        # timed rounds of each primitive; the best (or the median) is kept
PEAK_REPEATS = 3                  # timings of the GEMM that MFU's peak comes from, a pause between them
# (rows, seq_len, d_model, heads) of the blocks timed: overhead-bound to compute-bound
BLOCK_SHAPES = ((1, 16, 32, 2), (2, 32, 64, 2), (4, 64, 128, 4))
KEYS = ("nodes", "gpus_per_node", "cores_per_node", "mem_gb", "intra_bw_gbs", "inter_bw_gbs", "intra_latency_us",
        "inter_latency_us", "reduce_bw_gbs", "allgather_bw_gbs", "overlap", "tflops", "tflops_fp32", "tflops_fp64",
        "block_us", "act_ns", "optimizer_ns")


def calibrate_device(gpus_per_node: int | None = None, device: str = "auto") -> str:
    """--calibrate --device cpu | gpu | auto (a GPU when CuPy sees one): the [cluster] table to print."""
    if device == "gpu" or (device == "auto" and cupy_usable()):
        return calibrate_gpu(gpus_per_node)
    return calibrate(gpus_per_node)


# On one core: matmul
# FLOP/s per precision, the overhead and elementwise cost of a transformer block's forward and backward,
# AdamW per element. With every rank taking part: the latency and bandwidths of the collectives the
# engine calls, issued between block passes as the engine issues them. The result is a [cluster] table
# that `--cluster` reads back.
def calibrate(gpus_per_node: int | None = None) -> str:
    """Measure this machine and return a [cluster] table for --cluster (on rank 0; "" elsewhere)."""

    w, n = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_size()
    keep_heap()                      # as `hpengine train` runs: freed activations stay in the heap
    vals = _alone(w, lambda: _primitives(np))
    cores = physical_cores()
    gpn = gpus_per_node or (n if n > 1 else cores)
    if n > 1:
        vals.update(_collectives(w, np))
        cores = cores_in_effect(w, np, cores)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB / gpn
    vals.update(nodes=1, gpus_per_node=gpn, mem_gb=mem, cores_per_node=cores,
                inter_bw_gbs=vals["intra_bw_gbs"], inter_latency_us=vals["intra_latency_us"])
    if w.Get_rank():
        return ""
    return (f"# measured by hpengine plan --calibrate on {n} rank(s)\n[cluster]\n"
            + "".join(f"{k} = {v if isinstance(v, int) else f'{v:.4g}'}\n" for k, v in ((k, vals[k]) for k in KEYS)))


def physical_cores(cpuinfo: str = "/proc/cpuinfo", allowed=None) -> int:
    """The physical cores this process may run on: distinct (physical id, core id) pairs, read from Linux's
    `cpuinfo`, of the CPUs in `allowed` (default: this process's affinity). Two hyperthreads of a core
    share its arithmetic units, so they count once. Where the file is missing or gives no core ids (some
    ARM and virtual machines), the logical CPUs instead, hyperthreads unknown."""
    if allowed is None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    allowed = set(allowed)
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        text = ""
    entries = []                                   # one per "processor" line, with the lines after it
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "processor":
            entries.append({})
        if entries and key:
            entries[-1][key] = value
    cores = {(e.get("physical id", "0"), e["core id"]) for e in entries
             if e["processor"].isdigit() and int(e["processor"]) in allowed and "core id" in e}
    return len(cores) or len(allowed) or 1


def _alone(w, fn):
    """fn() on rank 0 while the other ranks sleep (a rank spinning in MPI would take a core from it
    when ranks outnumber cores): per-core figures whatever the world size. Broadcast to every rank."""
    out = fn() if w.Get_rank() == 0 else None
    req = w.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)
    return w.bcast(out, root=0)


# ---- one core ----------------------------------------------------------------------------------------

def gemm_rate(np, dtype, n: int = 768) -> float:
    """FLOP/s of one n x n x n matmul in dtype on this process (the best of ROUNDS rounds)."""
    a = np.ones((n, n), dtype=dtype)
    return 2 * n**3 / _per_call(lambda: a @ a)


def measured_peak(np, dtype, n: int) -> tuple[float, str]:
    """(peak FLOP/s of an n x n x n matmul in dtype on this process, where the figure comes from): the best
    of PEAK_REPEATS timings (one where a figure is cached), each the best of its rounds, and never below the
    best this machine showed before (peaks.best_peak): a start-up timed beside another job's work would
    put a step above its peak."""
    threads = pool_size()
    key = peak_key(np.dtype(dtype).name, n, threads)
    rate = 0.0
    for i in range(1 if cached_peak(key) else PEAK_REPEATS):
        if i:
            time.sleep(0.02)        # a burst of another process's work may end in the meantime
        rate = max(rate, gemm_rate(np, dtype, n))
    return best_peak(key, rate, cpu_bound(threads))


def raise_peak(np, dtype, n: int, rate: float) -> None:
    """File `rate` FLOP/s (a training step's, per rank) as measured_peak's figure when it is higher: the
    step proved the GEMM's timing low."""
    threads = pool_size()
    best_peak(peak_key(np.dtype(dtype).name, n, threads), rate, cpu_bound(threads))


def _primitives(np) -> dict:
    def rate(dtype, n=768):
        return gemm_rate(np, dtype, n)
    f32 = rate(np.float32)
    block_s, act_s = _block_costs(np, f32)
    a, b = np.ones(1 << 24), np.empty(1 << 24)     # one process: a memory copy stands in for the link
    return {"tflops_fp32": f32 / 1e12, "tflops_fp64": rate(np.float64) / 1e12, "tflops": rate(np.float16, 256) / 1e12,
            "block_us": block_s * 1e6, "act_ns": act_s * 1e9, "optimizer_ns": _optimizer_s(np) * 1e9,
            "intra_bw_gbs": a.nbytes / _per_call(lambda: np.copyto(b, a)) / GB, "intra_latency_us": 1.0,
            "reduce_bw_gbs": 0.0, "allgather_bw_gbs": 0.0, "overlap": 1.0}


def _block(np, rows: int, seq: int, width: int, heads: int) -> tuple:
    """(a function running one float32 GPT block's forward and backward as the engine does, counting
    its cache's bytes each way; the block's matmul FLOPs; the activation elements its forward caches)."""
    cfg = load_config(None, [f"model.seq_len={seq}", f"model.d_model={width}", f"model.n_heads={heads}",
                             "model.n_layers=1", "model.kind=gpt", "model.dtype=float32",
                             f"train.global_batch={rows}"])
    model = build_model(cfg.model)
    specs = model.specs("h.0")
    P, G = (FlatBuffer(Offsets(specs, 0, 1), np, np.float32) for _ in range(2))
    P.data[...] = np.random.default_rng(0).normal(0, 0.02, P.data.size)
    x = np.random.default_rng(1).normal(0, 1, (rows, seq, width)).astype(np.float32)

    def fb():
        y, cache = model.layer_forward(np, P, 0, x.copy(), LOCAL)
        cache_nbytes(cache, set())
        model.layer_backward(np, y, cache, P, G, 0, LOCAL)
        cache_nbytes(cache, set())
    weights = sum(math.prod(sp.global_shape) for sp in specs if len(sp.global_shape) == 2)
    act = block_activations(cfg.model, resolve(cfg, 1), 4)["layer"] / 4
    return fb, matmul_flops(cfg.model, rows * seq, weights, 1, 1), act


def _block_costs(np, flops: float) -> tuple:
    """(seconds of overhead per block pass, forward or backward; seconds per activation element the
    forward caches, forward and backward together): a least-squares fit of one GPT block's forward +
    backward at BLOCK_SHAPES, less its matmul FLOPs at the measured rate, to 2·overhead + elements·cost.
    What is left besides the matmuls is Python and NumPy call overhead (fixed per pass) and the
    layernorm, softmax, GELU and residual passes over the activations (proportional to them)."""
    rows = []
    for shape in BLOCK_SHAPES:
        fb, fl, act = _block(np, *shape)
        rows.append((_per_call(fb, 10) - fl / flops, act))
    A = np.array([[2.0, e] for _, e in rows])
    (over, per), *_ = np.linalg.lstsq(A, np.array([t for t, _ in rows]), rcond=None)
    return max(over, 1e-7), max(per, 1e-12)


def _optimizer_s(np, n: int = 1 << 20) -> float:
    """Seconds per owned element of the step's work over the owned range in float32: AdamW, the
    gradient's squared norm for clipping and zeroing it for the next step."""
    opt = AdamW(np, Offsets([ParamSpec("w", (n,))], 0, 1), Range(0, n), np.float32, (0.9, 0.95), 1e-8, 0.1)
    p, g = np.full(n, 0.1, np.float32), np.full(n, 1e-3, np.float32)

    def step():
        sum_of_squares(np, g)
        opt.step(p, g, 1e-3)
        g.fill(1e-3)
    return _per_call(step) / n


# ---- every rank ----------------------------------------------------------------------------------------

def cores_in_effect(w, np, physical: int) -> float:
    """The cores the ranks get in effect: ranks x (a block pass on rank 0 alone) / (the same pass on every
    rank at once), at most the node's. With fewer ranks than idle cores that is the rank count (no
    slow-down); with more ranks, or another job's processes on the cores, fewer."""
    fb = _block(np, *BLOCK_SHAPES[1])[0]
    alone = _alone(w, lambda: _per_call(fb, 10))
    together = min(_together(w, fb, 10) for _ in range(ROUNDS))
    return min(float(physical), w.Get_size() * alone / together)


def _collectives(w, np) -> dict:
    """Latency, bandwidths and overlap at this world size, each operation issued as the engine issues
    it: through its Comm wrapper, after a forward and backward pass of a small block. Ranks drift apart
    between calls, and with more ranks than cores a partner may be descheduled, so a call costs far
    more than back-to-back calls show. What a one-element allreduce adds to a loop of block passes is
    the latency (per round of recursive doubling); how the added time grows from 128 KiB to 4 MiB gives
    the bandwidth, over the bytes the alpha-beta model's ring moves, of an allreduce (the link's), of a
    reduce to one rank (reduce_bw: a block's gradient to its owner) and of gathering what one rank holds,
    started before the pass and waited for after it (allgather_bw: stage 3's prefetched block). MPI's
    algorithms differ: MPICH's reduce is slower than its allreduce, and a ring gathering one rank's
    block passes all of it through every rank."""
    n, c, one = w.Get_size(), Comm(w, "calibrate"), np.zeros(1)
    fb = _block(np, *BLOCK_SHAPES[1])[0]
    sizes = (1 << 15, 1 << 20)
    bufs = {m: np.ones(m, np.float32) for m in sizes}

    def allreduce(x):
        fb()
        c.allreduce_(x)

    def reduce(x):
        fb()
        waitall([c.ireduce(x, x if c.rank == 0 else None, root=0)])

    def gather(x):              # stage 3 prefetches: started before the pass, waited for after it
        req = c.iallgatherv_(x, [x.size] + [0] * (n - 1), [0] * n)
        fb()
        waitall([req])
    ops = {"intra_bw_gbs": allreduce, "reduce_bw_gbs": reduce, "allgather_bw_gbs": gather}
    after = {(k, m): (lambda f=f, m=m: f(bufs[m])) for k, f in ops.items() for m in sizes}
    after["latency"] = lambda: allreduce(one)
    rounds = []
    for _ in range(5):          # interleaved rounds, the median kept: the machine drifts while we measure
        base = _together(w, fb, 10)
        rounds.append({key: _together(w, fn, 10) - base for key, fn in after.items()})
    t = {key: sorted(r[key] for r in rounds)[2] for key in after}
    moved = {"intra_bw_gbs": 2 * (n - 1) / n, "reduce_bw_gbs": (n - 1) / n, "allgather_bw_gbs": (n - 1) / n}
    out = {k: f * 4 * (sizes[1] - sizes[0]) / max(t[k, sizes[1]] - t[k, sizes[0]], 1e-9) / GB
           for k, f in moved.items()}
    lat = max(t["latency"], 1e-7) / max(1, math.ceil(math.log2(n)))
    allreduce_s = moved["intra_bw_gbs"] * 4 * sizes[1] / (out["intra_bw_gbs"] * GB)
    return {**out, "intra_latency_us": lat * 1e6, "overlap": _overlap(w, c, fb, bufs[sizes[1]], allreduce_s)}


def _overlap(w, c, fb, big, allreduce_s: float) -> float:
    """Share of the shorter of three block passes and a 4 MiB allreduce hidden when it runs
    non-blocking beside them, tested after each pass as the engine's gradient sync does (MPI may
    progress it only inside such calls)."""

    def beside():
        req = [c.iallreduce_(big)]
        for _ in range(3):
            fb()
            testall(req)
        waitall(req)
    passes, both = (min(_together(w, fn, 3) for _ in range(3)) for fn in (lambda: [fb() for _ in range(3)], beside))
    return min(1.0, max(0.0, (passes + allreduce_s - both) / min(passes, allreduce_s)))


def _together(w, fn, reps: int) -> float:
    """Seconds per call of fn on every rank at once (the slowest rank's), after an untimed call."""
    fn()
    w.Barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return w.allreduce(time.perf_counter() - t, op=MPI.MAX) / reps


def _per_call(fn, reps: int = 3) -> float:
    """Seconds per call of fn, after one untimed warm-up call (the best of ROUNDS rounds: on a shared
    machine noise only adds, and a burst of another job's work can last a round)."""
    fn()
    best = math.inf
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best
