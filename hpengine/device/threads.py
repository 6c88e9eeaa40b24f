"""The size of each rank's CPU BLAS/OpenMP thread pool: N ranks on a node each starting one thread per core
fight over the same cores, so at start-up the engine sizes the pool itself, through threadpoolctl.
"""
from __future__ import annotations

import os

from threadpoolctl import threadpool_info, threadpool_limits

ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_chosen = "BLAS threads: not set up"


def bound_cores() -> frozenset[int]:
    """The cores this process may run on (its affinity mask; all CPUs where there is none)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def cores_text(cores) -> str:
    """Core numbers as ranges, e.g. "0-3,8"."""
    out, run = [], []
    for c in sorted(cores):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def share(mine, others) -> tuple[int, str]:
    """(threads, why) of the automatic rule: this rank's cores `mine` divided by the ranks sharing them,
    this one and those of `others` (the other ranks' core sets on this node) that overlap `mine`."""
    mine = frozenset(mine)
    sharing = 1 + sum(1 for o in others if mine & frozenset(o))
    n = max(1, len(mine) // sharing)
    return n, (f"automatic: this rank is bound to {len(mine)} core(s) ({cores_text(mine)}), shared by "
               f"{sharing} of the {1 + len(others)} rank(s) on the node")


def launcher_cores() -> frozenset[int]:
    """The cores this process's parent (the launcher or its node daemon) may run on; empty if unknown."""
    try:
        return frozenset(os.sched_getaffinity(os.getppid()))
    except (AttributeError, OSError):
        return frozenset()


def idle_note(node_sets, parent) -> str:
    """What the line adds when the node's ranks together are bound to fewer cores than their launcher may
    use (`parent`): those cores stay idle, and how to give them to the ranks; "" otherwise."""
    idle = frozenset(parent) - frozenset().union(*map(frozenset, node_sets))
    if not idle:
        return ""
    return (f"; cores {cores_text(idle)} of the {len(parent)} the launcher may use run no rank: it bound the ranks "
            "to fewer (Open MPI's mpirun binds each rank to one core at -n 1 and 2; --bind-to none, or "
            "--map-by slot:PE=N for N cores per rank)")


# Every rank's NumPy BLAS starts one thread per core it sees, so N ranks on a node run N x cores threads
# that fight over the same cores (8x slower on a 2-core machine at 2 ranks). At start-up the engine sizes
# the pool itself, through threadpoolctl:
#
# - `runtime.blas_threads = N` (N >= 1): N threads per rank;
# - else, when OMP_NUM_THREADS, OPENBLAS_NUM_THREADS or MKL_NUM_THREADS is set: nothing is changed
#   (the libraries read those variables themselves);
# - else (automatic): the cores this rank is bound to (its CPU affinity) divided by the ranks on its node
#   bound to cores that overlap them (this rank included), at least 1. Ranks bound to disjoint cores
#   (Open MPI's default binding at up to 2 ranks, srun's --cpu-bind) do not share; unbound ranks (MPICH's
#   default) all share the node.
def choose(setting: int, mine, others=(), environ=os.environ) -> tuple[int | None, str]:
    """(threads per rank, or None to leave the pools alone; the reason in words). mine: this rank's core
    set; others: the core sets of the other ranks on its node."""
    if setting and setting > 0:
        return setting, f"runtime.blas_threads = {setting}"
    explicit = [f"{v}={environ[v]}" for v in ENV_VARS if environ.get(v, "").strip()]
    if explicit:
        return None, f"set in the environment ({', '.join(explicit)})"
    return share(mine, others)


def pin(setting: int, mine, others=(), parent=None) -> str:
    """Size this process's BLAS/OpenMP pools as `choose` decides for its core set `mine` among the node's
    `others` (parent: the launcher's cores, for idle_note); returns the line to log (also kept for
    `describe`)."""
    global _chosen
    n, why = choose(setting, mine, others)
    if n is None:
        _chosen = f"BLAS threads per rank: left as {why}"
        return _chosen
    if why.startswith("automatic"):
        why += idle_note([mine, *others], launcher_cores() if parent is None else parent)
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
