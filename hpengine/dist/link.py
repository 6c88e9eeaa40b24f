"""A simulated slow link for one communicator (runtime.replica_link, DiLoCo's islands on one machine): each
array or control call there runs as usual, then sleeps until latency + bytes / bandwidth have passed since it
began, bytes as the counters count them. A simulation for tests and benchmarks, not a network model.
"""
from __future__ import annotations

import time

from hpengine.dist.comm import Comm

_ARRAYS = ("allreduce_", "allgatherv_", "bcast_", "reduce_scatter")
_OBJECTS = ("allreduce_obj", "bcast_obj", "allgather_obj", "barrier")


class SlowLink(Comm):
    """A Comm whose every blocking call takes at least `latency` + bytes / `rate` seconds (rate in bytes per
    second); `waited_s`: the seconds slept so far (the trace's "replica link" share of each call)."""

    def __init__(self, mpi_comm, name: str, backend=None, nccl=None, rate: float = float("inf"),
                 latency: float = 0.0):
        super().__init__(mpi_comm, name, backend, nccl)
        self.rate, self.latency, self.waited_s = rate, latency, 0.0

    def _hold(self, t0: float, nbytes: int) -> None:
        if self.size == 1:
            return
        left = self.latency + nbytes / self.rate - (time.perf_counter() - t0)
        if left > 0:
            t = self.tracer.now() if self.tracer is not None else None
            time.sleep(left)
            self.waited_s += left
            if t is not None:      # its own phase in the timeline, inside the call's event
                self.tracer.lap("replica link", t)


def _slowed(name: str, arrays: bool):
    plain = getattr(Comm, name)

    def call(self, *args, **kw):
        t0 = time.perf_counter()
        out = plain(self, *args, **kw)
        self._hold(t0, int(getattr(args[0], "nbytes", 0)) if arrays and args else 0)
        return out
    call.__name__, call.__doc__ = name, plain.__doc__
    return call


for _name in _ARRAYS + _OBJECTS:
    setattr(SlowLink, _name, _slowed(_name, _name in _ARRAYS))
