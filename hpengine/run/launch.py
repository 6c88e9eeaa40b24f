"""How the engine meets its launcher (mpiexec, srun, qsub): the world-size check against what the
launcher asked for, and SIGTERM/SIGUSR1 (sent before the wall time) and a first SIGINT (Ctrl-C) turned
into a stop request the training loop polls; a second SIGINT aborts the job at once; under Open MPI's
mpirun, which turns Ctrl-C and SIGTERM into a kill of every rank, a run's first lines say how to stop it
resumably and how to continue, and rank 0 says it again when such a signal comes.
The hang watchdog is dist/watchdog.py.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading

from mpi4py import MPI

from hpengine.dist.agree import agree_or_raise
from hpengine.dist.watchdog import abort_world

log = logging.getLogger("hpengine")

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
_state = {"signal": 0, "on_interrupt": None}     # per process: what the signal handlers set and read


class LaunchError(RuntimeError):
    """The job was started so that MPI's world differs from what the launcher asked for."""


# --- launcher sanity ----------------------------------------------------------------------------
def _int(env, key):
    try:
        return int(env[key])
    except (KeyError, ValueError):
        return None


def _nodefile_lines(path):
    try:
        with open(path) as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return None


def launcher_size(env=None):
    """(ranks, source, kind) that started this process, or None. kind "launched": a launcher set it for
    this very process (exact); "allocation": only the batch job's size (this may be one of its steps)."""
    env = os.environ if env is None else env
    exact = [("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
             ("PMI_SIZE", "a PMI launcher (Hydra mpiexec or srun --mpi=pmi2)"),
             ("SLURM_STEP_NUM_TASKS", "srun")]
    if "SLURM_STEP_ID" in env:   # inside an srun step these describe the step, not the allocation
        exact += [("SLURM_NTASKS", "srun"), ("SLURM_NPROCS", "srun")]
    for key, who in exact:
        if _int(env, key):
            return _int(env, key), f"{key}={env[key]}, set by {who}", "launched"
    for key in ("SLURM_NTASKS", "SLURM_NPROCS", "PBS_NP"):
        if _int(env, key):
            return _int(env, key), f"{key}={env[key]}, the batch job's size", "allocation"
    if env.get("PBS_NODEFILE") and _nodefile_lines(env["PBS_NODEFILE"]):
        n = _nodefile_lines(env["PBS_NODEFILE"])
        return n, f"PBS_NODEFILE={env['PBS_NODEFILE']} has {n} lines", "allocation"
    return None


def _hint(key: str, want: int, env) -> str:
    mine = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if key.startswith("OMPI_"):
        return ("the process was started by Open MPI's mpirun, but mpi4py uses another MPI library; launch "
                f"with that library's own mpiexec: {mine} -n {want} hpengine ...")
    srun = ("srun's --mpi type does not match the MPI library mpi4py uses (MPICH: srun --mpi=pmi2, Open MPI: "
            "--mpi=pmix; `srun --mpi=list` shows the choices), or set LAUNCHER=mpiexec in jobs/slurm_train.sbatch")
    other = f"the mpiexec that started it belongs to another MPI than mpi4py's; use {mine} -n {want}"
    if key.startswith("SLURM_"):
        return srun
    return f"{srun}; or, if not under srun, {other}" if "SLURM_STEP_ID" in env else other


def world_mismatch(size: int, env=None):
    """One-line error when MPI's world of `size` ranks differs from what the launcher asked for."""
    env = os.environ if env is None else env
    found = launcher_size(env)
    if found is None or found[0] == size:
        return None
    want, source, kind = found
    key = source.split("=")[0]
    lib = " ".join(MPI.Get_library_version().splitlines()[0].split())
    if kind == "allocation":   # a single process in a job shell (salloc, qsub -I) is legitimate
        if size > 1:
            log.warning("MPI world has %d ranks but the batch job asked for %d (%s)", size, want, source)
        return None
    return (f"the launcher asked for {want} ranks ({source}) but MPI formed a world of {size} rank(s) "
            f"({lib}){': every task runs alone as rank 0 of 1' if size == 1 else ''}. Likely fix: "
            + _hint(key, want, env))


def check_world(world, env=None) -> None:
    """Raise LaunchError on every rank when the world size is not what the launcher asked for. A
    sub-communicator (tests, embedding) is not checked: the launcher only knows COMM_WORLD."""
    if isinstance(world, MPI.Comm) and world != MPI.COMM_WORLD:
        return

    def check():
        err = world_mismatch(world.Get_size(), env)
        if err:
            raise LaunchError(err)
    agree_or_raise(world, check, LaunchError, (LaunchError,))   # environments may differ by rank


# --- stop on SIGTERM / SIGUSR1 ------------------------------------------------------------------
def open_mpi_kill_note(signum: int, env=None) -> str | None:
    """The line rank 0 writes when SIGTERM/SIGINT reaches it from Open MPI's mpirun (PRTE_LAUNCHED): mpirun
    sends SIGTERM when it is interrupted or terminated and SIGKILL about half a second later, too soon for
    a checkpoint; only SIGUSR1 passes through unchanged. None elsewhere, and on the other ranks."""
    env = os.environ if env is None else env
    if signum not in (signal.SIGTERM, signal.SIGINT) or env.get("PRTE_LAUNCHED") != "1" \
            or env.get("OMPI_COMM_WORLD_RANK", "0") != "0":
        return None
    pid = _mpirun_pid(env)
    return (f"hpengine: {signal.Signals(signum).name} from Open MPI's mpirun, which sends it when interrupted "
            "(Ctrl-C) or terminated and kills every rank half a second later: too soon for a checkpoint (the "
            f"last one saved stays). To stop cleanly, send SIGUSR1 to mpirun instead (kill -USR1 {pid}): the "
            "ranks save after their step and exit 75")


def _mpirun_pid(env) -> str:
    found = re.fullmatch(r"prterun-.+-(\d+)@\d+", env.get("PMIX_NAMESPACE", ""))   # prterun-HOST-PID@JOB
    return found.group(1) if found else "<pid of mpirun>"


def open_mpi_start_note(continue_cmd: str, env=None) -> str | None:
    """The line a run launched by Open MPI's mpirun (OMPI_COMM_WORLD_RANK set) logs first: Ctrl-C or SIGTERM
    to mpirun ends the ranks about half a second later, before a checkpoint and before any line can say
    how to go on, so how to stop resumably and `continue_cmd` are said up front. None elsewhere."""
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    return (f"launched by Open MPI's mpirun: Ctrl-C or SIGTERM to mpirun ends the ranks half a second later, "
            f"without a checkpoint. To stop resumably: send SIGUSR1 to mpirun (kill -USR1 {_mpirun_pid(env)}) or "
            "SIGTERM/SIGUSR1 to the ranks (kill -TERM with the pids in the run folder's ranks.jsonl; in a batch "
            "job of jobs/slurm_train.sbatch: scancel --batch --signal=TERM JOBID): they save after their step "
            f"and exit 75. To continue: {continue_cmd}")


def _tell_now(line: str) -> None:
    """Write `line` to the controlling terminal (mpirun has stopped forwarding the ranks' output by now),
    else to stderr."""
    data = (line + "\n").encode()
    try:
        fd = os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY)
    except OSError:
        fd = None
    try:
        os.write(2 if fd is None else fd, data)
    except OSError:
        pass
    finally:
        if fd is not None:
            os.close(fd)


def _on_signal(signum, frame):
    note = open_mpi_kill_note(signum) if not _state["signal"] else None
    if note:
        _tell_now(note)
    if signum == signal.SIGINT:
        if _state["signal"] == signal.SIGINT:     # a second Ctrl-C: no more waiting for the step boundary
            sys.stderr.write("hpengine: interrupted again: aborting the job\n")
            sys.stderr.flush()
            abort_world(130)
            raise KeyboardInterrupt
        if _state["on_interrupt"] is not None:
            _state["on_interrupt"]()
    _state["signal"] = signum


def on_interrupt(callback) -> None:
    """Call `callback()` (from the signal handler) when the first SIGINT arrives; None removes it."""
    _state["on_interrupt"] = callback


def install_stop_handlers(names=STOP_SIGNALS):
    """Make the given signals request a clean stop instead of killing the process; returns a function
    that restores the previous handlers. Outside the main thread (embedding) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _state["signal"] = 0
    sigs = [getattr(signal, n) for n in names if hasattr(signal, n)]
    old = {s: signal.signal(s, _on_signal) for s in sigs}

    def restore():
        for s, h in old.items():
            signal.signal(s, h)
    return restore


def stop_requested(comm=None):
    """Name of the stop signal this rank (or, with `comm`, any rank of it) received; None if none.
    With `comm` it is a collective, so every rank stops after the same step."""
    return step_boundary(comm)[0]


def step_boundary(comm=None, save_due: bool = False, writer: int = 0):
    """(stop signal's name or None, save due, writer state) agreed at a step boundary: the stop any rank
    received; a save due when it is due on any rank (a clock-based save: every rank saves after the same
    step); the largest of the ranks' asynchronous-writer states (checkpoint/background.py). With `comm` it
    is one collective."""
    sig, due = _state["signal"], int(bool(save_due))
    if comm is not None and comm.Get_size() > 1:
        sig, due, writer = comm.allreduce((sig, due, writer), op=_max_each)
    return (signal.Signals(sig).name if sig else None), bool(due), writer


def _max_each(a, b, datatype=None):
    """Element-wise maximum of two tuples (an mpi4py reduction of small objects)."""
    return tuple(max(x, y) for x, y in zip(a, b))
