"""A simulated slow link for one communicator (runtime.replica_link on the axis runtime.link_axis names: DiLoCo's
islands, or data parallel's gradients, on one machine): each call there runs as usual, then completes no earlier
than its turn on the link (bytes / bandwidth, one message after another, bytes as the counters count them) plus the
latency. A non-blocking call's wait is held until then. A simulation for tests and benchmarks, not a network model.
"""
from __future__ import annotations

import time

from mpi4py import MPI

from hpengine.dist.comm import Comm, Staged, _raw

_ARRAYS = ("allreduce_", "allgatherv_", "bcast_", "reduce_scatter", "alltoallv_")
_OBJECTS = ("allreduce_obj", "bcast_obj", "allgather_obj", "barrier")
_NONBLOCKING = ("iallreduce_", "iallgatherv_", "ialltoallv_")


class Held(Staged):
    """A non-blocking request on a SlowLink: complete once MPI's is and the link's `due` time has come."""

    def __init__(self, inner, link, due: float):
        super().__init__(_raw(inner), None, None, None)
        self.inner, self.link, self.due = inner, link, due

    def finish(self):
        if not self.done:
            self.done = True
            if isinstance(self.inner, Staged):
                self.inner.finish()
            self.link._sleep_until(self.due)

    def Test(self):
        if self.req.Test() and time.perf_counter() >= self.due:
            self.finish()
            return True
        return False


class SlowLink(Comm):
    """A Comm whose calls take their turn on a link of `rate` bytes per second and `latency` seconds: a message
    of b bytes sent at t completes at max(t, when the link is free) + b / rate + latency; `waited_s`: the seconds
    slept so far (the trace's "<axis> link" phase)."""

    def __init__(self, mpi_comm, name: str, backend=None, nccl=None, rate: float = float("inf"),
                 latency: float = 0.0):
        super().__init__(mpi_comm, name, backend, nccl)
        self.rate, self.latency, self.waited_s = rate, latency, 0.0
        self.free_at = 0.0          # when the link has sent every message queued so far

    def _due(self, t0: float, nbytes: int) -> float:
        """When a message of nbytes offered at t0 has arrived; queues it on the link."""
        self.free_at = max(t0, self.free_at) + nbytes / self.rate
        return self.free_at + self.latency

    def _sleep_until(self, due: float) -> None:
        left = due - time.perf_counter()
        if left > 0:
            t = self.tracer.now() if self.tracer is not None else None
            time.sleep(left)
            self.waited_s += left
            if t is not None:      # its own phase in the timeline, inside the call's event
                self.tracer.lap(f"{self.name} link", t)


def _slowed(name: str, arrays: bool):
    plain = getattr(Comm, name)

    def call(self, *args, **kw):
        t0 = time.perf_counter()
        out = plain(self, *args, **kw)
        if self.size > 1:
            self._sleep_until(self._due(t0, int(getattr(args[0], "nbytes", 0)) if arrays and args else 0))
        return out
    call.__name__, call.__doc__ = name, plain.__doc__
    return call


def _held(name: str):
    plain = getattr(Comm, name)

    def call(self, *args, **kw):
        t0 = time.perf_counter()
        req = plain(self, *args, **kw)
        if self.size == 1 or not isinstance(req, (Staged, MPI.Request)):     # NCCL's requests run unslowed
            return req
        return Held(req, self, self._due(t0, int(args[0].nbytes)))
    call.__name__, call.__doc__ = name, plain.__doc__
    return call


for _name in _ARRAYS + _OBJECTS:
    setattr(SlowLink, _name, _slowed(_name, _name in _ARRAYS))
for _name in _NONBLOCKING:
    setattr(SlowLink, _name, _held(_name))
