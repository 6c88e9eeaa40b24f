"""Phase timers and the per-rank timeline: a Tracer the engine, the pipeline executor and every traced
communicator report to (one perf_counter per phase; with recording on, compact event tuples). The run's
merged trace and breakdown are built from it in run/trace.py.
"""
from __future__ import annotations

import time
from collections import defaultdict, deque

_now = time.perf_counter_ns


class Tracer:
    """Phase timers; with `record`, also a timeline of (category, name, t0_ns, dur_ns, arg) tuples of
    which the most recent `max_events` are kept (bounded memory; older ones are counted as dropped).
    Times are host-side: on a GPU, kernels still running when a phase ends count towards a later one."""

    now = staticmethod(_now)

    def __init__(self, record: bool = False, max_events: int = 200_000):
        self.record, self.max_events = record, max_events
        self.seconds = defaultdict(float)
        self.events = deque(maxlen=max_events) if record else None
        self.offered = 0
        self.t_zero = _now()

    def lap(self, cat: str, t0: int, name: str | None = None, arg=None) -> int:
        """Close the phase `cat` that began at t0 (from now()); returns the time, to start the next one."""
        t1 = _now()
        self.seconds[cat] += (t1 - t0) * 1e-9
        if self.record:
            self.events.append((cat, name or cat, t0, t1 - t0, arg))
            self.offered += 1
        return t1

    def comm_start(self, comm: str, call: str, nbytes: int):
        """Token of an MPI call in progress (comm.py asks only when tracing is on)."""
        return (comm, call, nbytes, _now())

    def comm_end(self, tok, call: str | None = None) -> None:
        """Close the call of `tok`; `call` renames it (the NCCL call that carried it instead of MPI)."""
        comm, named, nbytes, t0 = tok
        self.lap("comm:" + comm, t0, call or named, nbytes)

    @property
    def dropped(self) -> int:
        return self.offered - len(self.events) if self.record else 0


OFF = Tracer()   # where evaluation's forward passes time themselves: never read, never recorded

