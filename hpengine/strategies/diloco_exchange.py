"""DiLoCo's quantised exchange of one fragment over the replica communicator, in two phases: an alltoallv sends chunk
j of every island's int8/int4 payload to island j, which averages its M copies and re-encodes the mean; an allgatherv
then gives every island every re-encoded chunk, so all hold the same bits. Blocking, or non-blocking in both phases
(the scales' MAX inside the island, on its fast communicators, is blocking).
"""
from __future__ import annotations

import numpy as np

from hpengine.dist.comm import testall, waitall
from hpengine.strategies import quantize


class QuantisedExchange:
    """One fragment's exchange: start() puts this island's payload on the wire (phase 1), reduce() waits for it and
    starts phase 2 with this island's chunk of the mean, mean() waits for that and decodes the whole mean. Every
    rank of the replica communicator calls them in the same order (non-blocking collectives match by order)."""

    def __init__(self, comm, xp, wire: quantize.Wire, dtype, nonblocking: bool, maxed=None):
        """wire: the fragment's payload layout on this rank (quantize.Wire); maxed: the MAX of a float32 vector over
        the island's ranks that hold parts of the same blocks (in place; None: this rank holds them whole)."""
        self.comm, self.xp, self.wire, self.dtype, self.maxed = comm, xp, wire, dtype, maxed
        self.nonblocking, self.M = nonblocking, comm.size
        self.req = self.recv = self.gathered = None

    def start(self, v):
        """Phase 1 for v (this island's values with their error feedback); returns what the others will read of
        v (the residual is v minus it)."""
        payload, seen, self.counts = quantize.encode(self.xp, v, self.wire, self.maxed)
        mine = self.counts[self.comm.rank]
        self.recv = self.xp.empty(self.M * mine, dtype=np.uint8)
        args = (payload, self.counts, self.recv, [mine] * self.M)
        if self.nonblocking:
            self.req = self.comm.ialltoallv_(*args)
        else:
            self.comm.alltoallv_(*args)
            self.reduce()
        return seen

    def reduce(self) -> None:
        """Phase 1 completed: this island's chunk of the mean into place, phase 2 started (once)."""
        if self.gathered is not None:
            return
        waitall([self.req])
        chunk = quantize.mean_chunk(self.xp, self.recv, self.wire, self.comm.rank, self.dtype, self.maxed)
        self.recv = None
        displs = [sum(self.counts[:r]) for r in range(self.M)]
        self.gathered = self.xp.empty(sum(self.counts), dtype=np.uint8)
        self.gathered[displs[self.comm.rank]:displs[self.comm.rank] + chunk.size] = chunk
        if self.nonblocking:
            self.req = self.comm.iallgatherv_(self.gathered, self.counts, displs)
        else:
            self.req = None
            self.comm.allgatherv_(self.gathered, self.counts, displs)

    def poll(self) -> None:
        """Let MPI progress the phase on the wire."""
        if self.req is not None:
            testall([self.req])

    def mean(self):
        """The islands' mean, as every island decodes it."""
        self.reduce()
        waitall([self.req])
        self.req = None
        return quantize.decode(self.xp, self.gathered, self.wire, self.dtype)
