"""The only module that hands arrays to mpi4py. Wraps one communicator per mesh axis, syncs the
device before MPI touches a buffer, and counts bytes and calls per operation so tests and the
planner can compare real traffic with the formulas.
"""
from __future__ import annotations

from collections import defaultdict

from mpi4py import MPI


class Comm:
    """A communicator plus traffic counters: stats[op] = [calls, bytes]."""

    def __init__(self, mpi_comm, name: str, backend=None):
        self.c = mpi_comm
        self.name = name
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.backend = backend
        self.stats = defaultdict(lambda: [0, 0])

    def _count(self, op, arr):
        st = self.stats[op]
        st[0] += 1
        st[1] += int(arr.nbytes)

    def _sync(self):
        if self.backend is not None:
            self.backend.sync()

    def reset_stats(self):
        self.stats.clear()

    # --- collectives on arrays (in place where the name says so) --------------------------------
    def allreduce_(self, arr, op=MPI.SUM):
        if self.size > 1:
            self._sync()
            self._count("allreduce", arr)
            self.c.Allreduce(MPI.IN_PLACE, arr, op=op)
        return arr

    def iallreduce_(self, arr, op=MPI.SUM):
        self._sync()
        self._count("allreduce", arr)
        return self.c.Iallreduce(MPI.IN_PLACE, arr, op=op)

    def ireduce(self, send, recv, root: int, op=MPI.SUM):
        """Non-blocking reduce of `send` into `recv` on `root` (recv ignored elsewhere; recv is send
        means in place on the root)."""
        self._sync()
        self._count("reduce", send)
        if self.rank != root:
            return self.c.Ireduce(send, None, op=op, root=root)
        if recv is send:
            return self.c.Ireduce(MPI.IN_PLACE, send, op=op, root=root)
        return self.c.Ireduce(send, recv, op=op, root=root)

    def allgatherv_(self, arr, counts, displs):
        """Every rank contributes arr[displs[r]:displs[r]+counts[r]]; all get the whole arr."""
        if self.size > 1:
            self._sync()
            self._count("allgather", arr)
            self.c.Allgatherv(MPI.IN_PLACE, [arr, counts, displs, None])
        return arr

    def iallgatherv_(self, arr, counts, displs):
        self._sync()
        self._count("allgather", arr)
        return self.c.Iallgatherv(MPI.IN_PLACE, [arr, counts, displs, None])

    def bcast_(self, arr, root: int):
        if self.size > 1:
            self._sync()
            self._count("bcast", arr)
            self.c.Bcast(arr, root=root)
        return arr

    def isend(self, arr, dest: int, tag: int):
        self._sync()
        self._count("send", arr)
        return self.c.Isend(arr, dest=dest, tag=tag)

    def irecv(self, arr, source: int, tag: int):
        self._count("recv", arr)
        return self.c.Irecv(arr, source=source, tag=tag)

    # --- small pickled control messages ---------------------------------------------------------
    def allreduce_obj(self, obj, op=MPI.SUM):
        return self.c.allreduce(obj, op=op) if self.size > 1 else obj

    def bcast_obj(self, obj, root: int = 0):
        return self.c.bcast(obj, root=root) if self.size > 1 else obj

    def allgather_obj(self, obj):
        return self.c.allgather(obj) if self.size > 1 else [obj]

    def barrier(self):
        if self.size > 1:
            self.c.Barrier()


def waitall(reqs) -> None:
    reqs = [r for r in reqs if r is not None]
    if reqs:
        MPI.Request.Waitall(reqs)


def testall(reqs) -> bool:
    """Let MPI progress outstanding requests (MPICH advances non-blocking collectives only inside
    MPI calls); True when all are complete."""
    return bool(MPI.Request.Testall(reqs)) if reqs else True
