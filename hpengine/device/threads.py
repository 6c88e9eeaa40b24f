"""The size of each rank's CPU BLAS/OpenMP thread pool.

Every rank's NumPy BLAS starts one thread per core it sees, so N ranks on a node run N x cores threads
that fight over the same cores (8x slower on a 2-core machine at 2 ranks). At start-up the engine sizes
the pool itself, through threadpoolctl:

- `runtime.blas_threads = N` (N >= 1): N threads per rank;
- else, when OMP_NUM_THREADS, OPENBLAS_NUM_THREADS or MKL_NUM_THREADS is set: nothing is changed
  (the libraries read those variables themselves);
- else (automatic): the cores this process may run on (its CPU affinity) divided by the ranks on its
  node, at least 1.
"""
from __future__ import annotations

import os

from threadpoolctl import threadpool_info, threadpool_limits

ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_chosen = "BLAS threads: not set up"


def available_cores() -> int:
    """Cores this process may run on (its affinity mask; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose(setting: int, ranks_on_node: int, cores: int, environ=os.environ) -> tuple[int | None, str]:
    """(threads per rank, or None to leave the pools alone; the reason in words)."""
    if setting and setting > 0:
        return setting, f"runtime.blas_threads = {setting}"
    explicit = [f"{v}={environ[v]}" for v in ENV_VARS if environ.get(v, "").strip()]
    if explicit:
        return None, f"set in the environment ({', '.join(explicit)})"
    n = max(1, cores // max(1, ranks_on_node))
    return n, f"automatic: {cores} core(s) available / {ranks_on_node} rank(s) on the node"


def pin(setting: int, ranks_on_node: int) -> str:
    """Size this process's BLAS/OpenMP pools as `choose` decides; returns the line to log (also kept for
    `describe`)."""
    global _chosen
    n, why = choose(setting, ranks_on_node, available_cores())
    if n is None:
        _chosen = f"BLAS threads per rank: left as {why}"
        return _chosen
    threadpool_limits(limits=n)       # applies now, for the life of the process
    _chosen = f"BLAS threads per rank: {n} ({why}; set OMP_NUM_THREADS or runtime.blas_threads to override)"
    return _chosen


def describe() -> str:
    """The line `pin` last returned."""
    return _chosen


def pool_size() -> int | None:
    """Threads of this process's BLAS pool now (the largest, as threadpoolctl reports it), None where no BLAS
    library is loaded: what `pin`, or the environment it left alone, put in effect."""
    sizes = [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]
    return max(sizes) if sizes else None
