"""The only module that hands arrays to mpi4py. Wraps one communicator per mesh axis, syncs the
device before MPI touches a buffer (staging through pinned host memory when the MPI is not CUDA-aware),
and counts bytes and calls per operation so tests and the planner can compare traffic with formulas.
"""
from __future__ import annotations

import ctypes
import logging
import time
from collections import defaultdict

from mpi4py import MPI

from hpengine.dist.nccl import Request as NcclRequest, Twin
from hpengine.dist.nccl_p2p import open_channels
from hpengine.dist.watchdog import note_comm

log = logging.getLogger("hpengine")


class Staged:
    """A non-blocking request whose host staging buffer is copied back into the device array when it
    completes (only used on a GPU without CUDA-aware MPI); `due`: no earlier than this perf_counter time (a
    simulated link's, dist/link.py)."""
    due = 0.0

    def __init__(self, req, host, arr, backend):
        self.req, self.host, self.arr, self.backend, self.done = req, host, arr, backend, False

    def finish(self):
        if not self.done:
            self.done = True
            if self.arr is not None:
                self.backend.stage_in(self.host, self.arr)

    def Wait(self):
        self.req.Wait()
        self.finish()

    def Test(self):
        if self.req.Test():
            self.finish()
            return True
        return False


# With an NCCL twin (runtime.collectives = "nccl", dist/nccl.py) device buffers go to NCCL instead for the
# calls NCCL has, sends and receives on the directed channels a caller opened (dist/nccl_p2p.py); control
# messages and host buffers stay on MPI.
class Comm:
    """A communicator plus traffic counters: stats[op] = [calls, bytes], whichever library carried them;
    nccl_stats[op] = [calls, bytes] of those NCCL carried. `nccl`: the device adapter of dist/nccl.py
    (nccl.choose) when this communicator gets an NCCL twin (collective over mpi_comm)."""

    def __init__(self, mpi_comm, name: str, backend=None, nccl=None):
        self.c = mpi_comm
        self.name = name
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.backend = backend
        self.stats = defaultdict(lambda: [0, 0])
        self.nccl_stats = defaultdict(lambda: [0, 0])
        self._types = {}            # strided datatypes of allgather_axis1, by shape
        self.twin = Twin(mpi_comm, nccl) if nccl is not None and self.size > 1 else None
        self._via = None            # the NCCL call the last method made (the tracer's name for it)
        self.channels = {}          # (src, dst, key) -> this rank's nccl_p2p.Channel
        self._opened = set()        # every channel opened on this communicator, the same on every rank
        self.on_close = []          # callables that complete what their owner left on the wire, run by close()

    def _count(self, op, arr, nccl_call=None):
        st = self.stats[op]
        st[0] += 1
        st[1] += int(arr.nbytes)
        if nccl_call:
            st = self.nccl_stats[op]
            st[0] += 1
            st[1] += int(arr.nbytes)
            self._via = nccl_call
        note_comm(op, self.name, arr.nbytes)     # what the hang watchdog names if this call never returns

    def _nccl(self, *arrays, op=MPI.SUM) -> bool:
        """Whether this call's arrays go to the NCCL twin (device buffers, a dtype and op NCCL has)."""
        return self.twin is not None and self.twin.takes(*arrays, op=op)

    def close(self) -> None:
        """Complete what owners left on the wire (on_close), destroy the NCCL twin and channels (the MPI
        communicator is the mesh's to free)."""
        for done in self.on_close:
            done()
        self.on_close = []
        for ch in self.channels.values():
            ch.close()
        self.channels = {}
        if self.twin is not None:
            self.twin.close()
            self.twin = None

    def _out(self, arr, copy=True):
        """The buffer MPI may touch for arr (arr itself on NumPy or CUDA-aware MPI), after a sync."""
        return arr if self.backend is None else self.backend.stage_out(arr, copy)

    def _in(self, buf, arr):
        if buf is not arr:
            self.backend.stage_in(buf, arr)

    def _req(self, req, buf, arr):
        return req if buf is arr or arr is None else Staged(req, buf, arr, self.backend)

    def reset_stats(self):
        self.stats.clear()
        self.nccl_stats.clear()

    # Timeline events. Off (tracer None) the methods are the plain ones above, so tracing off
    # costs nothing; on, this instance's methods are shadowed by timed wrappers (trace.Tracer).
    tracer = None

    def set_tracer(self, tracer) -> None:
        """Record every call (MPI name, communicator, bytes, start/end) on `tracer`; None stops."""
        self.tracer = tracer if self.size > 1 else None
        for meth, call in TRACED.items():
            if self.tracer is None:
                self.__dict__.pop(meth, None)
            else:
                setattr(self, meth, _timed(self, call, getattr(type(self), meth)))

    # --- collectives on arrays (in place where the name ends in _) ----------------------------
    def allreduce_(self, arr, op=MPI.SUM):
        if self.size > 1 and self._nccl(arr, op=op):
            self._count("allreduce", arr, "ncclAllReduce")
            self.twin.allreduce(arr, op).join()
        elif self.size > 1:
            self._count("allreduce", arr)
            buf = self._out(arr)
            self.c.Allreduce(MPI.IN_PLACE, buf, op=op)
            self._in(buf, arr)
        return arr

    def iallreduce_(self, arr, op=MPI.SUM):
        if self._nccl(arr, op=op):
            self._count("allreduce", arr, "ncclAllReduce")
            return self.twin.allreduce(arr, op)
        self._count("allreduce", arr)
        buf = self._out(arr)
        return self._req(self.c.Iallreduce(MPI.IN_PLACE, buf, op=op), buf, arr)

    def ireduce(self, send, recv, root: int, op=MPI.SUM):
        """Non-blocking reduce of `send` into `recv` on `root` (recv ignored elsewhere; recv is send
        means in place on the root)."""
        self._count("reduce", send)
        sbuf = self._out(send)
        if self.rank != root:
            return self._req(self.c.Ireduce(sbuf, None, op=op, root=root), sbuf, None)
        if recv is send:
            return self._req(self.c.Ireduce(MPI.IN_PLACE, sbuf, op=op, root=root), sbuf, send)
        rbuf = self._out(recv, copy=False)
        return self._req(self.c.Ireduce(sbuf, rbuf, op=op, root=root), rbuf, recv)

    def allgatherv_(self, arr, counts, displs):
        """Every rank contributes arr[displs[r]:displs[r]+counts[r]]; all get the whole arr."""
        if self.size > 1 and self._nccl(arr, op=None):
            req, call = self.twin.allgatherv(arr, counts, displs)
            self._count("allgather", arr, call)
            req.join()
        elif self.size > 1:
            self._count("allgather", arr)
            buf = self._out(arr)
            self.c.Allgatherv(MPI.IN_PLACE, [buf, counts, displs, None])
            self._in(buf, arr)
        return arr

    def iallgatherv_(self, arr, counts, displs):
        if self._nccl(arr, op=None):
            req, call = self.twin.allgatherv(arr, counts, displs)
            self._count("allgather", arr, call)
            return req
        self._count("allgather", arr)
        buf = self._out(arr)
        return self._req(self.c.Iallgatherv(MPI.IN_PLACE, [buf, counts, displs, None]), buf, arr)

    def allgather_axis1(self, send, recv):
        """recv (B, size x n, ...) = every rank's send (B, n, ...) placed at rank x n along axis 1, gathered
        straight into place by a strided MPI datatype (no reordering copy); counted as recv's bytes."""
        if self.size == 1:
            recv[...] = send
            return recv
        self._count("allgather", recv)
        B, block = send.shape[0], send[0].nbytes
        key = (B, block, recv[0].nbytes)
        dt = self._types.get(key)
        if dt is None:
            vec = MPI.BYTE.Create_vector(B, block, recv[0].nbytes)
            dt = self._types[key] = vec.Create_resized(0, block)
            dt.Commit()
            vec.Free()
        sbuf, rbuf = self._out(send), self._out(recv, copy=False)
        self.c.Allgather([sbuf, send.nbytes, MPI.BYTE], [rbuf, 1, dt])
        self._in(rbuf, recv)
        return recv

    def reduce_scatter(self, send, recv, op=MPI.SUM):
        """recv = block `rank` of the sum over ranks of send (size equal blocks); counted as send's bytes."""
        if self.size == 1:
            recv.reshape(-1)[...] = send.reshape(-1)
            return recv
        if self._nccl(send, recv, op=op) and recv.size * self.size == send.size:
            self._count("reduce_scatter", send, "ncclReduceScatter")
            self.twin.reduce_scatter(send, recv, op).join()
            return recv
        self._count("reduce_scatter", send)
        sbuf, rbuf = self._out(send), self._out(recv, copy=False)
        self.c.Reduce_scatter_block(sbuf, rbuf, op=op)
        self._in(rbuf, recv)
        return recv

    def bcast_(self, arr, root: int):
        if self.size > 1 and self._nccl(arr, op=None):
            self._count("bcast", arr, "ncclBroadcast")
            self.twin.bcast(arr, root).join()
        elif self.size > 1:
            self._count("bcast", arr)
            buf = self._out(arr, copy=self.rank == root)
            self.c.Bcast(buf, root=root)
            self._in(buf, arr)
        return arr

    # --- point-to-point ---------------------------------------------------------------------------
    def open_channels(self, wanted) -> None:
        """Directed NCCL channels for `wanted`, (src, dst, key) triples every rank passes alike (collective;
        nothing without a twin). isend / irecv with channel=key then hand device arrays to the channel
        (me, dest, key) / (source, me, key); NCCL matches by issue order, so a key must name a message
        sequence that both ends send and receive in the same order (tags do not reach NCCL)."""
        if self.twin is not None:
            self.channels.update(open_channels(self.c, self.twin, wanted, self._opened))

    def _channel(self, src, dst, key, arr):
        """The channel that carries this send or receive, or None: no such channel, or an array NCCL does
        not take (host memory, a dtype NCCL lacks), which MPI carries by tag as without channels."""
        ch = self.channels.get((src, dst, key)) if key is not None else None
        return ch if ch is not None and self.twin.takes(arr, op=None) else None

    def isend(self, arr, dest: int, tag: int, channel=None):
        ch = self._channel(self.rank, dest, channel, arr)
        if ch is not None:
            self._count("send", arr, "ncclSend")
            return ch.send(arr)
        self._count("send", arr)
        buf = self._out(arr)
        return self._req(self.c.Isend(buf, dest=dest, tag=tag), buf, None)

    def irecv(self, arr, source: int, tag: int, channel=None):
        """Wait() on the request: the data is in arr for later work (on a channel the compute stream waits
        for it on the device; the host goes on)."""
        ch = self._channel(source, self.rank, channel, arr)
        if ch is not None:
            self._count("recv", arr, "ncclRecv")
            return ch.recv(arr)
        self._count("recv", arr)
        buf = self._out(arr, copy=False)
        return self._req(self.c.Irecv(buf, source=source, tag=tag), buf, arr)

    # --- small pickled control messages ---------------------------------------------------------
    def allreduce_obj(self, obj, op=MPI.SUM):
        return self.c.allreduce(obj, op=op) if self.size > 1 else obj

    def bcast_obj(self, obj, root: int = 0):
        return self.c.bcast(obj, root=root) if self.size > 1 else obj

    def allgather_obj(self, obj):
        return self.c.allgather(obj) if self.size > 1 else [obj]

    def alltoall_obj(self, objs: list) -> list:
        """objs[r] to rank r; returns what every rank sent here, by rank (small pickled control messages)."""
        return self.c.alltoall(objs) if self.size > 1 else list(objs)

    def _alltoallv_args(self, send, send_rows, recv, recv_rows):
        row = int(send[0].size) if send.shape[0] else int(recv[0].size) if recv.shape[0] else 1
        sc, rc = [int(n) * row for n in send_rows], [int(n) * row for n in recv_rows]
        sd, rd = [sum(sc[:r]) for r in range(self.size)], [sum(rc[:r]) for r in range(self.size)]
        self._count("alltoallv", send)
        sbuf, rbuf = self._out(send), self._out(recv, copy=False)
        return [sbuf.reshape(-1), (sc, sd)], [rbuf.reshape(-1), (rc, rd)], rbuf

    def alltoallv_(self, send, send_rows, recv, recv_rows):
        """Rows of send (n, ...) to every rank, send_rows[r] of them (consecutive, in rank order) to rank r;
        recv gets recv_rows[r] rows from each rank r, in rank order. Counted as send's bytes."""
        s, r, rbuf = self._alltoallv_args(send, send_rows, recv, recv_rows)
        self.c.Alltoallv(s, r)
        self._in(rbuf, recv)
        return recv

    def ialltoallv_(self, send, send_rows, recv, recv_rows):
        """Non-blocking alltoallv_: recv holds the rows once the request completes (send untouched until then)."""
        s, r, rbuf = self._alltoallv_args(send, send_rows, recv, recv_rows)
        return self._req(self.c.Ialltoallv(s, r), rbuf, recv)

    def barrier(self):
        if self.size > 1:
            self.c.Barrier()


def _raw(r):
    return r.req if isinstance(r, Staged) else r


def waitall(reqs) -> None:
    """Wait for MPI and NCCL requests."""
    reqs = [r for r in reqs if r is not None]
    mpi = [r for r in reqs if not isinstance(r, NcclRequest)]
    for r in reqs:
        if isinstance(r, NcclRequest):
            r.Wait()
    if mpi:
        MPI.Request.Waitall([_raw(r) for r in mpi])
        for r in mpi:
            if isinstance(r, Staged):
                r.finish()


def testall(reqs) -> bool:
    """Let MPI progress outstanding requests (MPICH advances non-blocking collectives only inside
    MPI calls); True when all are complete (NCCL requests included)."""
    if not reqs:
        return True
    mpi = [r for r in reqs if not isinstance(r, NcclRequest)]
    nccl_done = all([r.Test() for r in reqs if isinstance(r, NcclRequest)])
    if mpi and not MPI.Request.Testall([_raw(r) for r in mpi]):
        return False
    if not nccl_done:
        return False
    now = time.perf_counter()
    if any(isinstance(r, Staged) and r.due > now for r in mpi):
        return False
    for r in mpi:
        if isinstance(r, Staged):
            r.finish()
    return True


# the Comm methods a tracer times, with the MPI call each stands for
TRACED = {"allreduce_": "Allreduce", "iallreduce_": "Iallreduce", "ireduce": "Ireduce", "allgatherv_": "Allgatherv",
          "iallgatherv_": "Iallgatherv", "allgather_axis1": "Allgather",
          "reduce_scatter": "Reduce_scatter_block", "bcast_": "Bcast", "isend": "Isend", "irecv": "Irecv",
          "allreduce_obj": "allreduce", "bcast_obj": "bcast", "allgather_obj": "allgather", "barrier": "Barrier",
          "alltoall_obj": "alltoall", "alltoallv_": "Alltoallv",
          "ialltoallv_": "Ialltoallv"}


def _timed(comm, call, fn):
    """fn (an unbound Comm method) as a timeline event named after the MPI call, or the NCCL call when the
    twin carried it: non-blocking calls span their issue only."""
    def timed(*args, **kw):
        tok = comm.tracer.comm_start(comm.name, call, int(getattr(args[0], "nbytes", 0)) if args else 0)
        comm._via = None
        out = fn(comm, *args, **kw)
        comm.tracer.comm_end(tok, comm._via)
        return out
    return timed


def mpi_cuda_support() -> bool:
    """Whether the MPI library says it reads and writes CUDA device buffers (False when it says
    nothing): MPI 4.1's mpi_memory_alloc_kinds, else MPIX_Query_cuda_support (Open MPI, MPICH)."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        return bool(query())
    kinds = MPI.INFO_ENV.Get("mpi_memory_alloc_kinds") or ""
    if "cuda" in kinds:
        return True
    try:
        fn = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    fn.restype, fn.argtypes = ctypes.c_int, []
    return bool(fn())


def resolve_cuda_aware(setting, backend) -> bool:
    """runtime.cuda_aware_mpi ('auto' | True | False) for this backend: device buffers go straight to
    MPI only on a GPU backend and, under 'auto', only when the library says it can take them."""
    if not backend.is_gpu:
        return False
    if setting == "auto" or setting is None:
        return mpi_cuda_support()
    if setting is True and not mpi_cuda_support():
        log.warning("runtime.cuda_aware_mpi = true but the MPI library does not report CUDA support; "
                    "device buffers are passed to MPI anyway")
    return bool(setting)
