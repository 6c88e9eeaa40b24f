"""The progress line and the fields it adds to every metrics.jsonl row: elapsed time and ETA, model FLOPs
utilisation (MFU) against a peak the backend knows or the user sets, memory (peak RSS on the CPU, device memory
in use on a GPU) and an optimizer other than the default; and whether the line may redraw itself with "\r".
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import resource
import statistics
import sys
import time

import numpy as np

from hpengine.config.tree import OptimConfig
from hpengine.planner.calibrate import _alone, measured_peak, raise_peak
from hpengine.planner.peaks import PEAK_TFLOPS, precision_of, table_peak
from hpengine.run.startguard import under_launcher
from hpengine.run.trace import model_flops

# The ETA is the median step time, the first WARMUP steps of the run left out, times the steps left.
WARMUP = 3           # first steps of a run (start-up, first touches of memory) left out of the ETA
RECENT = 50          # steps whose median wall time gives the ETA

log = logging.getLogger("hpengine")


def device_name(backend) -> str:
    """The CUDA device's name, e.g. "NVIDIA H200"; "cpu" on NumPy."""
    if not backend.is_gpu:
        return "cpu"
    name = backend.xp.cuda.runtime.getDeviceProperties(backend.device or 0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


# MFU = model FLOPs of a step (trace.model_flops: 6 x Psi x tokens + attention, all models) / the step's
# train time / (peak FLOP/s per rank x ranks). The peak per rank is runtime.peak_tflops when set; else, on
# a GPU, the dense figure of NVIDIA's datasheet for the device (PEAK_TFLOPS) at the precision the GEMMs run
# in; else, on the CPU, the best float GEMM rate this machine has shown (calibrate.measured_peak, cached
# per machine). A step above its peak proves the peak wrong: MFU is null ("n/a") from then on, never > 100 %.
def peak_per_rank(cfg, backend, world, compute_dtype: str) -> tuple[float | None, str]:
    """(peak FLOP/s of one rank, where the figure comes from); (None, why) when no peak is known.
    Collective on the CPU path (rank 0 times the GEMM while the others sleep; every rank gets its figure)."""
    if cfg.runtime.peak_tflops > 0:
        return cfg.runtime.peak_tflops * 1e12, "runtime.peak_tflops"
    prec = precision_of(cfg)
    if backend.is_gpu:
        name = device_name(backend)
        peak = table_peak(name, prec)
        if peak is None:
            return None, (f"no peak known for the GPU '{name}' (the table knows "
                          f"{', '.join(k for k, _ in PEAK_TFLOPS)}): set runtime.peak_tflops")
        return peak * 1e12, f"{name}, dense {prec} datasheet figure"

    n = gemm_size(compute_dtype)
    rate, where = _alone(world, lambda: measured_peak(np, np.dtype(compute_dtype), n))
    return rate, f"{compute_dtype} {n}^3 GEMM on one rank's BLAS threads, {where}"


def gemm_size(compute_dtype: str) -> int:
    """n of the n x n x n GEMM whose rate is the CPU's peak."""
    return 256 if compute_dtype == "float16" else 512


def memory_bytes(backend) -> int:
    """Peak RSS of this process on the CPU; device memory in use (all processes) on a GPU."""
    if backend.is_gpu:
        free, total = backend.xp.cuda.runtime.memGetInfo()
        return int(total - free)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# Rows and the progress line name the optimizer where it is not the default (AdamW), as they name the model only
# where several train and the MoE figures only for MoE models: a default run's rows stay as they were.
DEFAULT_OPTIMIZER = OptimConfig().name


class Progress:
    """Counts this run's optimizer steps and adds elapsed_s, eta_s, mfu and mem_bytes to a step's metrics, and
    `optimizer` (optim.name) where it is not DEFAULT_OPTIMIZER. total: the last step to run (train.steps); start:
    the optimizer steps done before this run (resume); peak_total: FLOP/s of all ranks (None: no MFU);
    exceeded(rate): told once when a step ran at `rate` FLOP/s, above the peak (which is wrong then: MFU is None
    from that step on)."""

    def __init__(self, total: int, start: int, flops_step: float, peak_total: float | None, mem=lambda: 0,
                 clock=time.perf_counter, exceeded=None, optimizer: str = DEFAULT_OPTIMIZER):
        self.total, self.done, self.flops_step, self.peak = total, start, flops_step, peak_total
        self.mem, self.clock, self.exceeded = mem, clock, exceeded
        self.named = {} if optimizer == DEFAULT_OPTIMIZER else {"optimizer": optimizer}
        self.t0 = self.last = clock()
        self.early = []                                    # the first WARMUP step times of this run
        self.recent = collections.deque(maxlen=RECENT)     # the step times after them

    def update(self, m: dict) -> dict:
        """The new fields of step m (its step_ms is the train step's time); also counts the step."""
        now = self.clock()
        self.done += 1
        (self.early if len(self.early) < WARMUP else self.recent).append(now - self.last)
        self.last = now
        return {"mfu": self._mfu(m["step_ms"] / 1e3), "elapsed_s": now - self.t0, "eta_s": self.eta(),
                "mem_bytes": self.mem(), **self.named}

    def _mfu(self, step_s: float) -> float | None:
        if not self.peak or step_s <= 0:
            return None
        rate = self.flops_step / step_s
        if rate > self.peak:
            log.info("MFU n/a from step %d on: the step ran at %.4g TFLOP/s, above the peak of %.4g TFLOP/s "
                     "MFU is measured against, so that peak is too low (timed while other work ran, or set "
                     "too low: runtime.peak_tflops gives the device's)", self.done, rate / 1e12, self.peak / 1e12)
            if self.exceeded is not None:
                self.exceeded(rate)
            self.peak = None
            return None
        return rate / self.peak

    def eta(self) -> float | None:
        """Seconds to the last step: the median step time after the warm-up (before it is over, of the
        steps after the first) times the steps left; None while only the first step has run."""
        left = max(self.total - self.done, 0)
        times = self.recent or self.early[1:]
        if not left:
            return 0.0
        return statistics.median(times) * left if times else None

    def label(self) -> str:
        """"N/total": optimizer steps completed, of the run's total."""
        return f"{self.done}/{self.total}"


def redraws(stream=None, env=None) -> bool:
    """Whether the progress line may redraw itself with "\r": only when a person watches a terminal, that is
    stdout is one and no launcher started this process. Under any launcher (mpiexec, mpirun, srun) the
    rank's stdout is the launcher's forwarder, even where that looks like a terminal (Open MPI's pty), and
    a batch log would fill with lines glued together; files and pipes get plain lines too."""
    if under_launcher(os.environ if env is None else env):
        return False
    stream = sys.stdout if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):          # replaced or closed stdout
        return False


def hms(seconds: float | None) -> str:
    """h:mm:ss; "n/a" for an unknown time."""
    if seconds is None:
        return "n/a"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def suffix(m: dict, gpu: bool = False) -> str:
    """What the progress line shows after tok/s and ms: MFU ("n/a" where its peak is unknown or proved
    wrong; never above 100 %), memory, elapsed and ETA."""
    out = ""
    if "mfu" in m:
        mfu = m["mfu"]
        out = f" | MFU {100 * mfu:.1f}%" if mfu is not None and 0 <= mfu <= 1 else " | MFU n/a"
    if "mem_bytes" in m:
        out += f" | {'dev mem' if gpu else 'RSS'} {m['mem_bytes'] / 2**20:,.0f} MiB"
    if "elapsed_s" in m:
        out += f" | {hms(m['elapsed_s'])} elapsed, ETA {hms(m.get('eta_s'))}"
    return out


def begin(eng, cfg, world, first: int, compute_dtype: str, log) -> Progress:
    """The run's Progress (first: the optimizer steps already done), logging where MFU's peak comes from
    (or why there is none). Collective."""
    flops, _ = model_flops(eng)
    peak, why = peak_per_rank(cfg, eng.be, world, compute_dtype)
    n = world.Get_size()
    if peak is None:
        log.info("MFU not shown: %s", why)
    else:
        log.info("MFU against %.4g TFLOP/s per rank x %d rank(s) (%s); %.4g GFLOP per step", peak / 1e12, n, why,
                 flops / 1e9)
    measured = peak is not None and not cfg.runtime.peak_tflops > 0 and not eng.be.is_gpu
    # a step that proves the measured peak low raises the cached figure (rank 0 keeps it): the next run starts there
    exceeded = functools.partial(_raise, compute_dtype, n) if measured and world.Get_rank() == 0 else None
    return Progress(cfg.train.steps, first, flops, None if peak is None else peak * n,
                    mem=lambda: memory_bytes(eng.be), exceeded=exceeded, optimizer=cfg.optim.name)


def _raise(compute_dtype: str, ranks: int, rate: float) -> None:
    raise_peak(np, np.dtype(compute_dtype), gemm_size(compute_dtype), rate / ranks)
