"""A NumPy stand-in for CuPy's NCCL binding and for backend.CudaNccl, so the CPU tests can check which calls
hpengine hands to NCCL, with which arguments, and that the results equal MPI's. It checks routing, not
NCCL: each stand-in collective is carried at once by a blocking MPI collective, so its events are done when
recorded; a channel's send and receive are an Isend and an Irecv with one fixed tag on the channel's own MPI
communicator, so MPI's non-overtaking order matches them by issue order, as NCCL does, and their events are
done when the MPI requests are. A "pointer" is the array itself, a "stream handle" the stream itself; every
NumPy array counts as device memory except a HostArray.
"""
from __future__ import annotations

import os
from collections import Counter

import numpy as np
from mpi4py import MPI

from hpengine.device.backend import BackendError

UID_BYTES = 128
P2P_TAG = 5         # every send and receive of a channel: matched by issue order alone


class HostArray(np.ndarray):
    """A NumPy array the stand-in device treats as host memory (what stays on MPI)."""


def host(a) -> HostArray:
    return np.asarray(a).view(HostArray)


class Event:
    """The stand-in's event: done when the MPI requests queued on its stream before it are (none for the
    collectives, which have finished when they return)."""

    def __init__(self, reqs=()):
        self.reqs, self.waited = list(reqs), 0

    def wait(self):
        self.waited += 1
        MPI.Request.Waitall(self.reqs)

    def test(self) -> bool:
        return MPI.Request.Testall(self.reqs)


class Stream:
    """A channel's stream: its queued MPI requests, what it carried ("send" / "recv"), and whether it was
    made to wait for the compute stream since its last call (Device.stream)."""

    def __init__(self):
        self.pending, self.carried, self.after_compute = [], set(), False

    def take(self, what: str) -> None:
        assert self.after_compute, f"a {what} on a stream that did not first wait for the compute stream"
        self.after_compute = False
        self.carried.add(what)
        assert len(self.carried) == 1, "one stream carried both sends and receives"


class Device:
    """Stands in for backend.CudaNccl; `fail` makes module() raise the way a missing NCCL does."""

    def __init__(self, module, fail: str | None = None):
        self.nccl, self.fail = module, fail
        self.joined = 0             # blocking calls ordered before the compute stream's next work
        self.streams = []           # the channels' streams

    def module(self):
        if self.fail:
            raise BackendError(self.fail)
        return self.nccl

    def on_device(self, arr) -> bool:
        return isinstance(arr, np.ndarray) and not isinstance(arr, HostArray)

    def ptr(self, arr):
        return arr

    def new_stream(self) -> Stream:
        self.streams.append(Stream())
        return self.streams[-1]

    def stream(self, s=None):
        if s is None:
            return 0
        s.after_compute = True
        return s

    def record(self, s=None) -> Event:
        if s is None:
            return Event()
        s.pending = [r for r in s.pending if r != MPI.REQUEST_NULL]     # completed ones are null
        return Event(s.pending)

    def synchronize(self, event) -> None:
        event.wait()

    def join(self, event) -> None:
        """The compute stream waiting for event: what it runs next sees the data, so a receive must be in."""
        self.joined += 1
        event.wait()

    def done(self, event) -> bool:
        return event.test()


class Module:
    """Stands in for cupy.cuda.nccl. Collective over COMM_WORLD (it duplicates it for its rendezvous)."""

    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
    DT = {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64", 6: "float16", 7: "float32",
          8: "float64"}
    MPI_OPS = {0: MPI.SUM, 1: MPI.PROD, 2: MPI.MAX, 3: MPI.MIN}
    available = True

    def __init__(self):
        self.world = MPI.COMM_WORLD.Dup()          # hellos of the rendezvous
        self.world2 = MPI.COMM_WORLD.Dup()         # Create_group, apart from the hellos
        self.made, self.comms = [], []
        self.calls = Counter()                     # NCCL call name -> count, on this rank
        self.group = 0

    def free(self):
        for c in self.comms:
            c.destroy()
        self.world.Free()
        self.world2.Free()

    def get_unique_id(self) -> bytes:
        """Like NCCL's, the id names its maker (its world rank, as NCCL's holds the root's address)."""
        head = np.array([self.world.Get_rank(), len(self.made)], dtype=np.int64).tobytes()
        uid = head + os.urandom(UID_BYTES - len(head))
        self.made.append(uid)
        return uid

    def NcclCommunicator(self, size, uid, rank):     # noqa: N802 - cupy's name
        c = Communicator(self, size, uid, rank)
        self.comms.append(c)
        return c

    def groupStart(self):       # noqa: N802
        self.group += 1

    def groupEnd(self):         # noqa: N802
        assert self.group > 0, "groupEnd without groupStart"
        self.group -= 1


class Communicator:
    """The stand-in NcclCommunicator: its ranks found through the maker named in the id, then an MPI
    communicator of them (Create_group, collective over those ranks only, as NCCL's init is)."""

    def __init__(self, mod, size, uid, rank):
        assert isinstance(uid, bytes) and len(uid) == UID_BYTES, "the unique id must reach every rank whole"
        self.mod, self.uid, self.rank, self.size = mod, uid, rank, size
        root, count = (int(v) for v in np.frombuffer(uid[:16], dtype=np.int64))
        w, tag = mod.world, count % 30000 + 1
        me = w.Get_rank()
        if rank == 0:
            assert root == me and uid in mod.made, "rank 0 of a twin must be the rank that made its id"
            members = {0: me}
            for _ in range(size - 1):
                r, world_rank, got = w.recv(source=MPI.ANY_SOURCE, tag=tag)
                assert got == uid, f"nccl rank {r} got another unique id than rank 0 made"
                members[r] = world_rank
            order = [members[r] for r in range(size)]
            for r in range(1, size):
                w.send(order, dest=order[r], tag=tag)
        else:
            w.send((rank, me, uid), dest=root, tag=tag)
            order = w.recv(source=root, tag=tag)
        assert order[rank] == me
        self.members = order
        self.c = mod.world2.Create_group(mod.world2.Get_group().Incl(order), tag=(root * 977 + count) % 30000)

    def destroy(self):
        if self.c is not None:
            self.c.Free()
            self.c = None

    def _check(self, arr, count, dtype, moving=False):
        """moving: a call that only moves bytes, where NCCL's type need only have the array's width."""
        assert isinstance(arr, np.ndarray) and not isinstance(arr, HostArray), "a host buffer reached NCCL"
        assert arr.flags.c_contiguous and arr.size == count, (arr.shape, count)
        want = np.dtype(Module.DT[dtype])
        assert arr.dtype == want or (moving and arr.dtype.itemsize == want.itemsize and arr.dtype.kind == "u"), \
            (arr.dtype, dtype)

    def _note(self, name):
        self.mod.calls[name] += 1

    def allReduce(self, send, recv, count, dtype, op, stream):     # noqa: N802
        self._check(send, count, dtype)
        self._check(recv, count, dtype)
        self._note("ncclAllReduce")
        self.c.Allreduce(MPI.IN_PLACE if send is recv else send, recv, op=Module.MPI_OPS[op])

    def reduceScatter(self, send, recv, recvcount, dtype, op, stream):     # noqa: N802
        self._check(send, recvcount * self.size, dtype)
        self._check(recv, recvcount, dtype)
        self._note("ncclReduceScatter")
        self.c.Reduce_scatter_block(send, recv, op=Module.MPI_OPS[op])

    def allGather(self, send, recv, count, dtype, stream):     # noqa: N802
        self._check(send, count, dtype, moving=True)
        self._check(recv, count * self.size, dtype, moving=True)
        in_place = send.__array_interface__["data"][0] == recv.__array_interface__["data"][0] + \
            self.rank * count * recv.itemsize
        self._note("ncclAllGather")
        self.c.Allgather(MPI.IN_PLACE if in_place else send, recv)

    def broadcast(self, send, recv, count, dtype, root, stream):
        self._check(recv, count, dtype, moving=True)
        self._note("ncclBroadcast")
        if self.rank == root and send is not recv:
            recv[...] = send
        self.c.Bcast(recv, root=root)

    def _p2p(self, arr, count, dtype, peer, stream, what):
        self._check(arr, count, dtype, moving=True)
        assert self.size == 2 and peer == 1 - self.rank, f"a channel's {what} to peer {peer} from rank {self.rank}"
        assert isinstance(stream, Stream), f"a {what} on the collectives' stream, not a channel's"
        stream.take(what)
        self._note("ncclSend" if what == "send" else "ncclRecv")

    def send(self, buf, count, dtype, peer, stream):
        self._p2p(buf, count, dtype, peer, stream, "send")
        stream.pending.append(self.c.Isend(buf, dest=peer, tag=P2P_TAG))

    def recv(self, buf, count, dtype, peer, stream):
        self._p2p(buf, count, dtype, peer, stream, "recv")
        stream.pending.append(self.c.Irecv(buf, source=peer, tag=P2P_TAG))
