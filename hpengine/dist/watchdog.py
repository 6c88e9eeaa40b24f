"""The per-rank hang watchdog: a daemon thread that, when no heartbeat comes in time, names the rank, its
mesh coordinates, its phase and the last communication it entered (dist/comm.py notes each one here),
dumps every thread's stack and aborts the whole job. A phase given a progress probe (a checkpoint save:
`progress`, the bytes this process has written) is no hang while the probe moves, however long it lasts.
"""
from __future__ import annotations

import contextlib
import faulthandler
import sys
import threading
import time
import traceback

from mpi4py import MPI

# phases that read or write files (or evaluate) may take longer than a step: their limit is scaled
SLOW_PHASES = ("start", "restore", "data", "evaluate", "checkpoint")
SLOW_FACTOR, SLOW_FLOOR_S = 10.0, 300.0
_state = {"where": "", "comm": None, "progress": 0}     # per process: what the watchdog and the abort path name


def where() -> str:
    """This rank's mesh prefix, as told to the latest Watchdog ('' before one exists)."""
    return _state["where"]


def note_comm(op: str, comm: str, nbytes: int) -> None:
    """Record the communication call this rank is entering; the watchdog names it when it fires."""
    _state["comm"] = (op, comm, int(nbytes))


def note_progress(nbytes: int = 1) -> None:
    """Record work done in a long phase (bytes copied or written by a checkpoint writer); `progress` reads it."""
    _state["progress"] += int(nbytes)


def progress():
    """A probe for heartbeat(): what this process has written to files and sockets so far (Linux's wchar,
    which grows with every write and pwrite, from any thread) and what note_progress recorded."""
    try:
        with open("/proc/self/io", "rb") as f:
            written = next((int(x.split()[1]) for x in f if x.startswith(b"wchar:")), 0)
    except (OSError, ValueError, IndexError):        # no /proc: what note_progress recorded alone
        written = 0
    return written, _state["progress"]


def abort_world(code: int = 1):
    MPI.COMM_WORLD.Abort(code)


class Watchdog:
    """A daemon thread per rank: when no heartbeat comes for `timeout_s` seconds, write one line naming
    the rank, its mesh coordinates and the last step/phase, dump every thread's stack, abort the job.
    timeout_s = 0 turns it off; `abort` and `stream` are replaceable for tests. The prefix is also what
    the abort path of the command line (cli._abort) names as this rank's mesh coordinates.

    The limit is per phase: timeout_s for a training step; for the SLOW_PHASES (start-up, loading,
    evaluation, checkpoint saves) max(SLOW_FACTOR * timeout_s, slow_floor_s), since their time grows with
    the model and the file system rather than with the step. A heartbeat with a `progress` probe counts each
    change of the probe's value as one more heartbeat of that phase."""

    def __init__(self, timeout_s: float, prefix: str = "", abort=None, stream=None, grace_s: float = 1.0,
                 slow_floor_s: float = SLOW_FLOOR_S):
        self.timeout_s, self.prefix, self.slow_floor_s = float(timeout_s), prefix, float(slow_floor_s)
        self.abort, self.stream, self.grace_s = abort or abort_world, stream, grace_s
        self.step, self.phase, self.fired = None, "start", False
        self._beat = (None, "start", time.monotonic(), None)     # (step, phase, time, progress probe)
        self._stop = threading.Event()
        self._thread = None
        _state["where"] = prefix or _state["where"]

    def start(self) -> "Watchdog":
        if self.timeout_s > 0 and self._thread is None:
            self._beat = (*self._beat[:2], time.monotonic(), self._beat[3])
            self._thread = threading.Thread(target=self._run, name="hpengine-watchdog", daemon=True)
            self._thread.start()
        return self

    def heartbeat(self, step=None, phase: str = "step", progress=None) -> None:
        """Step `step` is in `phase` now; `progress`: a function whose value changes while the phase moves."""
        self.step, self.phase = step, phase
        self._beat = (step, phase, time.monotonic(), progress)   # one assignment: the thread reads a whole beat

    @contextlib.contextmanager
    def during(self, phase: str, progress=None):
        """Inside: `phase` (of the same step); after: the phase before, with a fresh heartbeat."""
        step, before = self.step, self.phase
        self.heartbeat(step, phase, progress)
        try:
            yield
        finally:
            self.heartbeat(step, before)

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
        moved = None            # (beat, when its probe last changed, the probe's value then)
        while not self._stop.wait(poll):
            beat = self._beat       # the limit, the idle time and the line all come from this one beat
            step, phase, last, probe = beat
            if probe is not None:
                value = _read(probe)
                if moved is None or moved[0] is not beat:
                    moved = (beat, last, value)
                elif value != moved[2]:
                    moved = (beat, time.monotonic(), value)
                last = moved[1]
            idle, limit = time.monotonic() - last, self.limit(phase)
            if idle > limit:
                self._fire(idle, step, phase, limit)
                return

    def _fire(self, idle: float, step, phase: str, limit: float) -> None:
        self.fired = True
        out = self.stream or sys.stderr
        rank = MPI.COMM_WORLD.Get_rank()
        comm = _state["comm"]
        last = f"; last communication entered: {comm[0]} on '{comm[1]}', {comm[2]:,} bytes" if comm else ""
        at = "before the first step" if step is None else f"in step {step}"
        out.write(f"hpengine: watchdog: rank {rank} {self.prefix} made no progress for {idle:.1f} s "
                  f"(runtime.watchdog_s = {self.timeout_s:g}, limit {limit:g} s in this phase), {at}, "
                  f"phase '{phase}'{last}; "
                  f"stacks of all threads follow, then the job is aborted\n")
        _dump_stacks(out)
        time.sleep(self.grace_s)   # the other ranks' watchdogs fire too: let them write before the abort
        self.abort()


def _read(probe):
    """The probe's value; None when it fails (a probe never stops the watchdog)."""
    try:
        return probe()
    except Exception:  # noqa: BLE001 - whatever the probe raises, the watchdog keeps watching
        return None


def _dump_stacks(out) -> None:
    try:
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
    except (AttributeError, OSError, ValueError):   # a stream without a file descriptor (captured output)
        for ident, frame in sys._current_frames().items():
            out.write(f"Thread 0x{ident:x}:\n{''.join(traceback.format_stack(frame))}")
    out.flush()


