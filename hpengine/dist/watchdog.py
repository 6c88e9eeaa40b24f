"""The per-rank hang watchdog: a daemon thread that, when no heartbeat comes in time, names the rank, its
mesh coordinates, its phase and the last communication it entered (dist/comm.py notes each one here),
dumps every thread's stack and aborts the whole job.
"""
from __future__ import annotations

import faulthandler
import sys
import threading
import time
import traceback

from mpi4py import MPI

# phases that read or write files (or evaluate) may take longer than a step: their limit is scaled
SLOW_PHASES = ("start", "restore", "data", "evaluate", "checkpoint")
SLOW_FACTOR, SLOW_FLOOR_S = 10.0, 300.0
_state = {"where": "", "comm": None}     # per process: what the watchdog and the abort path name


def where() -> str:
    """This rank's mesh prefix, as told to the latest Watchdog ('' before one exists)."""
    return _state["where"]


def note_comm(op: str, comm: str, nbytes: int) -> None:
    """Record the communication call this rank is entering; the watchdog names it when it fires."""
    _state["comm"] = (op, comm, int(nbytes))


def abort_world(code: int = 1):
    MPI.COMM_WORLD.Abort(code)


class Watchdog:
    """A daemon thread per rank: when no heartbeat comes for `timeout_s` seconds, write one line naming
    the rank, its mesh coordinates and the last step/phase, dump every thread's stack, abort the job.
    timeout_s = 0 turns it off; `abort` and `stream` are replaceable for tests. The prefix is also what
    the abort path of the command line (cli._abort) names as this rank's mesh coordinates.

    The limit is per phase: timeout_s for a training step; for the SLOW_PHASES (start-up, loading,
    evaluation, checkpoint saves) max(SLOW_FACTOR * timeout_s, slow_floor_s), since their time grows with
    the model and the file system rather than with the step."""

    def __init__(self, timeout_s: float, prefix: str = "", abort=None, stream=None, grace_s: float = 1.0,
                 slow_floor_s: float = SLOW_FLOOR_S):
        self.timeout_s, self.prefix, self.slow_floor_s = float(timeout_s), prefix, float(slow_floor_s)
        self.abort, self.stream, self.grace_s = abort or abort_world, stream, grace_s
        self.step, self.phase, self.fired = None, "start", False
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        _state["where"] = prefix or _state["where"]

    def start(self) -> "Watchdog":
        if self.timeout_s > 0 and self._thread is None:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="hpengine-watchdog", daemon=True)
            self._thread.start()
        return self

    def heartbeat(self, step=None, phase: str = "step") -> None:
        self.step, self.phase, self._last = step, phase, time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def limit(self, phase: str | None = None) -> float:
        """Seconds without a heartbeat after which the watchdog fires in `phase` (default: the current)."""
        phase = self.phase if phase is None else phase
        return max(SLOW_FACTOR * self.timeout_s, self.slow_floor_s) if phase in SLOW_PHASES else self.timeout_s

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _run(self):
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self.limit():
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        self.fired = True
        out = self.stream or sys.stderr
        rank = MPI.COMM_WORLD.Get_rank()
        comm = _state["comm"]
        last = f"; last communication entered: {comm[0]} on '{comm[1]}', {comm[2]:,} bytes" if comm else ""
        at = "before the first step" if self.step is None else f"in step {self.step}"
        out.write(f"hpengine: watchdog: rank {rank} {self.prefix} made no progress for {idle:.1f} s "
                  f"(runtime.watchdog_s = {self.timeout_s:g}, limit {self.limit():g} s in this phase), {at}, "
                  f"phase '{self.phase}'{last}; "
                  f"stacks of all threads follow, then the job is aborted\n")
        _dump_stacks(out)
        time.sleep(self.grace_s)   # the other ranks' watchdogs fire too: let them write before the abort
        self.abort()


def _dump_stacks(out) -> None:
    try:
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
    except (AttributeError, OSError, ValueError):   # a stream without a file descriptor (captured output)
        for ident, frame in sys._current_frames().items():
            out.write(f"Thread 0x{ident:x}:\n{''.join(traceback.format_stack(frame))}")
    out.flush()


