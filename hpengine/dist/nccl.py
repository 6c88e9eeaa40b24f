"""NCCL twins of the mesh's communicators (runtime.collectives = "nccl"): deciding once, on every rank
together, whether NCCL is usable; making a communicator's twin (rank 0's unique id broadcast over MPI); and
the NCCL collectives comm.py hands device buffers to, with requests that waitall and testall understand.
"""
from __future__ import annotations

import logging
import socket

import numpy as np
from mpi4py import MPI

from hpengine.device.backend import BackendError

log = logging.getLogger("hpengine")

# NumPy dtype -> the name of NCCL's enum for it in the nccl module (bfloat16 is float32 storage or uint16 bits here)
DTYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "int8": "NCCL_INT8",
          "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32", "int64": "NCCL_INT64",
          "uint64": "NCCL_UINT64"}
# what only moves bytes (broadcast, all-gather, send, receive) may also be a dtype NCCL lacks of the same width:
# bfloat16 bits (uint16, packed storage) travel as NCCL's 16-bit float, untouched
MOVED_AS = {"uint16": "NCCL_FLOAT16"}
OPS = ((MPI.SUM, "NCCL_SUM"), (MPI.PROD, "NCCL_PROD"), (MPI.MAX, "NCCL_MAX"), (MPI.MIN, "NCCL_MIN"))


def choose(setting: str, backend, world, device=None):
    """The device adapter every rank hands NCCL calls through, or None when MPI carries everything.

    runtime.collectives = "nccl" on a GPU backend with NCCL importable on every rank and no two ranks on one
    device (agreed over `world`) gives the adapter (`device`, or the backend's own); otherwise every rank logs
    the same one warning line naming the first rank that cannot and why, and all use MPI."""
    if setting != "nccl":
        return None
    why = None
    try:
        device = device if device is not None else backend.nccl_device()
        device.module()
    except BackendError as exc:
        why = str(exc)
    place = (socket.gethostname(), getattr(backend, "device", None))      # NCCL takes one device per rank
    got = world.allgather((why, place)) if world.Get_size() > 1 else [(why, place)]
    whys, places = [w for w, _ in got], [p for _, p in got]
    for r, (host, dev) in enumerate(places):
        if whys[r] is None and dev is not None and places.index((host, dev)) != r:
            whys[r] = (f"it shares CUDA device {dev} on {host} with rank {places.index((host, dev))} "
                       "(runtime.share_devices), and NCCL takes one device per rank")
    bad = [(r, w) for r, w in enumerate(whys) if w is not None]
    if not bad:
        return device
    r, w = bad[0]
    where = f"rank {r}" + (f" and {len(bad) - 1} other(s)" if len(bad) > 1 else "")
    log.warning("runtime.collectives = 'nccl' but NCCL is not usable on %s (%s): MPI carries every call", where, w)
    return None


# The NCCL collectives run on a stream of their own after what the compute
# stream has queued, with requests that waitall and testall understand (sends and receives go on the
# directed channels of nccl_p2p.py).
class Request:
    """An NCCL call in flight on NCCL's stream: Wait() blocks the host until it is done, Test() asks, join()
    orders the compute stream after it without blocking the host (the blocking calls of comm.py)."""

    def __init__(self, dev, arrays, event):
        self.dev, self.arrays, self.event = dev, arrays, event     # arrays: kept alive until done

    def Wait(self):
        self.dev.synchronize(self.event)
        self.arrays = None

    def join(self):
        """Later work on the compute stream (which allocates and frees on it) runs after this call."""
        self.dev.join(self.event)
        return self

    def Test(self) -> bool:
        if not self.dev.done(self.event):
            return False
        self.arrays = None
        return True


class Arrival(Request):
    """A receive in flight on a channel's stream: Wait() orders the compute stream after the data arrived
    (join) and leaves the host going on; whoever reads the data on the host syncs the compute stream."""

    def Wait(self):
        self.join()
        self.arrays = None


# The device side (pointers, streams, events, the nccl module) comes from
# an adapter: backend.CudaNccl on a GPU, a NumPy stand-in in the CPU tests.
class Twin:
    """The NCCL communicator beside one MPI communicator (collective over it: every rank builds the twin of
    every communicator it belongs to, in the same order, as the mesh makes them)."""

    def __init__(self, mpi_comm, device):
        self.dev, self.nccl = device, device.module()
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        uid = self.nccl.get_unique_id() if self.rank == 0 else None
        self.uid = mpi_comm.bcast(uid, root=0)
        self.comm = self.nccl.NcclCommunicator(self.size, self.uid, self.rank)
        self.dtypes = {np.dtype(k): getattr(self.nccl, v) for k, v in DTYPES.items() if hasattr(self.nccl, v)}
        self.moves = {**self.dtypes, **{np.dtype(k): getattr(self.nccl, v) for k, v in MOVED_AS.items()
                                        if hasattr(self.nccl, v)}}
        self.ops = [(mpi, getattr(self.nccl, name)) for mpi, name in OPS if hasattr(self.nccl, name)]

    def close(self) -> None:
        self.comm.destroy()

    # --- which calls NCCL takes ------------------------------------------------------------------
    def _op(self, op):
        return next((n for mpi, n in self.ops if op == mpi), None)

    def takes(self, *arrays, op=MPI.SUM) -> bool:
        """Whether NCCL carries a call on these arrays: device arrays, contiguous, of a dtype and a reduction
        NCCL has (op None: a call that only moves data, MOVED_AS too); anything else stays on MPI."""
        types = self.moves if op is None else self.dtypes
        return all(self.dev.on_device(a) and a.flags.c_contiguous and a.dtype in types for a in arrays) \
            and (op is None or self._op(op) is not None)

    def _args(self, arr, moving=False):
        return self.dev.ptr(arr), arr.size, (self.moves if moving else self.dtypes)[arr.dtype]

    def _done(self, *arrays) -> Request:
        return Request(self.dev, arrays, self.dev.record())

    # --- collectives, queued on NCCL's stream ------------------------------------------------
    def allreduce(self, arr, op=MPI.SUM) -> Request:
        p, n, dt = self._args(arr)
        self.comm.allReduce(p, p, n, dt, self._op(op), self.dev.stream())
        return self._done(arr)

    def reduce_scatter(self, send, recv, op=MPI.SUM) -> Request:
        p, _, dt = self._args(send)
        self.comm.reduceScatter(p, self.dev.ptr(recv), recv.size, dt, self._op(op), self.dev.stream())
        return self._done(send, recv)

    def allgatherv(self, arr, counts, displs) -> tuple[Request, str]:
        """Every rank's arr[displs[r]:displs[r]+counts[r]] to all, in place: one allGather when the pieces
        are equal and back to back, else one broadcast per rank in one NCCL group (NCCL has no allgatherv).
        Returns the request and the NCCL call it made."""
        flat, s = arr.reshape(-1), self.dev.stream()
        n, dt = counts[0], self.moves[arr.dtype]
        if all(c == n for c in counts) and list(displs) == [r * n for r in range(self.size)] and flat.size == n * self.size:
            mine = flat[self.rank * n:(self.rank + 1) * n]
            self.comm.allGather(self.dev.ptr(mine), self.dev.ptr(flat), n, dt, s)
            return self._done(arr), "ncclAllGather"
        self.nccl.groupStart()
        try:
            for r, (c, d) in enumerate(zip(counts, displs)):
                if c:
                    piece = self.dev.ptr(flat[d:d + c])
                    self.comm.broadcast(piece, piece, c, dt, r, s)
        finally:
            self.nccl.groupEnd()
        return self._done(arr), "ncclBroadcast"

    def bcast(self, arr, root: int) -> Request:
        p, n, dt = self._args(arr, moving=True)
        self.comm.broadcast(p, p, n, dt, root, self.dev.stream())
        return self._done(arr)
