"""How the engine meets its launcher (mpiexec, mpirun, srun, qsub): the world-size check; how the run was
launched, which every continue line repeats; SIGTERM/SIGUSR1 and a first SIGINT (Ctrl-C) turned into a stop
request the training loop polls (a second SIGINT aborts); under Open MPI's mpirun, which kills every rank on
Ctrl-C or SIGTERM, the first lines say how to stop resumably and continue. Hang watchdog: dist/watchdog.py.
"""
from __future__ import annotations

import logging
import os
import re
import shlex
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


# --- how the run was launched: recorded in the run folder, repeated by every continue line -----------
_TYPED = {"mpiexec": ("mpiexec", "mpiexec.hydra", "mpirun"), "mpirun": ("mpirun", "mpiexec")}


def launched_as(env=None, size=None) -> dict:
    """How this process was started, from what its launcher set in the environment: {"launcher": "mpiexec"
    (MPICH's Hydra or another PMI mpiexec) | "mpirun" (Open MPI) | "srun" | None (no launcher: one process),
    "program": the launcher as typed where this process's parents show it (else its bare name), "args":
    launcher options that matter to a relaunch, "ranks": `size`, else the launcher's count}. With `env`
    given, a pure function of it (no process is looked at)."""
    real = env is None
    env = os.environ if env is None else env
    found = launcher_size(env)
    ranks = size or (found[0] if found and found[2] == "launched" else 1)
    step = "SLURM_STEP_ID" in env
    hydra = "HYDI_CONTROL_FD" in env or "MPI_LOCALNRANKS" in env       # Hydra's proxy sets these, srun does not
    if env.get("PRTE_LAUNCHED") == "1" or "OMPI_MCA_orte_hnp_uri" in env or \
            (_int(env, "OMPI_COMM_WORLD_SIZE") and not step):
        launcher, args = "mpirun", []
    elif _int(env, "PMI_SIZE") and (hydra or not step):
        launcher, args = "mpiexec", []
    elif step and (_int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "PMI_SIZE") or _int(env, "OMPI_COMM_WORLD_SIZE")):
        mpi = env.get("SLURM_MPI_TYPE", "")
        launcher, args = "srun", ([f"--mpi={mpi}"] if mpi and mpi != "none" else [])
    else:
        return {"launcher": None, "program": None, "args": [], "ranks": ranks}
    program = (_typed_launcher(_TYPED[launcher]) if real and launcher in _TYPED else None) or launcher
    return {"launcher": launcher, "program": program, "args": args, "ranks": ranks}


def launch_record(size: int, mesh: dict) -> dict:
    """What launch.json and summary.json record of this start: launched_as(size=size), the mesh's degrees and
    "command", the launch to repeat (None for one process started without a launcher)."""
    found = {**launched_as(size=size), "mesh": dict(mesh)}
    return {**found, "command": shlex.join(launch_words(found)) or None}


def launch_words(launched: dict) -> list[str]:
    """The launch to repeat, as argv words before `hpengine`: [program, args..., "-n", ranks]; [] for a
    process started without a launcher."""
    if not launched or not launched.get("launcher"):
        return []
    return [launched.get("program") or launched["launcher"], *launched.get("args", []), "-n", str(launched["ranks"])]


def _typed_launcher(names, depth: int = 3) -> str | None:
    """argv[0] of the nearest of this process's `depth` ancestors whose program is named one of `names`: the
    rank's parent is its supervisor (run/supervisor.py), whose parent is Open MPI's mpirun, or Hydra's proxy
    whose parent is mpiexec. None when none is, or /proc cannot say (another node, another OS)."""
    pid = os.getpid()
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode()
        except (OSError, ValueError, IndexError, UnicodeDecodeError):
            return None
        if pid <= 1:
            return None
        if argv0.isprintable() and os.path.basename(argv0) in names:
            return argv0
    return None


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
