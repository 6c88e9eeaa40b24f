"""Directed NCCL point-to-point channels beside a communicator's twin (runtime.collectives = "nccl"): one
2-rank NcclCommunicator per (sender, receiver, key), each with a stream of its own, so a stream carries only
the sends of one message sequence (on the sender) or only its receives (on the receiver). NCCL matches a
send with a receive by issue order, not tag: a key must name a sequence both ends issue in the same order.
"""
from __future__ import annotations

from hpengine.dist.nccl import Arrival, Request


class Channel:
    """One direction of one ordered message sequence between two ranks: the sender is NCCL rank 0 (it made
    the unique id), the receiver NCCL rank 1."""

    def __init__(self, twin, uid, sending: bool):
        self.dev, self.dtypes, self.sending = twin.dev, twin.moves, sending
        self.comm = twin.nccl.NcclCommunicator(2, uid, 0 if sending else 1)
        self.stream = twin.dev.new_stream()

    def close(self) -> None:
        self.comm.destroy()

    def send(self, arr) -> Request:
        # the stream first waits for what the compute stream queued: arr's producer
        s = self.dev.stream(self.stream)
        self.comm.send(self.dev.ptr(arr), arr.size, self.dtypes[arr.dtype], 1, s)
        return Request(self.dev, (arr,), self.dev.record(self.stream))

    def recv(self, arr) -> Arrival:
        # ... here the last reader of arr, a receive buffer the caller reuses
        s = self.dev.stream(self.stream)
        self.comm.recv(self.dev.ptr(arr), arr.size, self.dtypes[arr.dtype], 0, s)
        return Arrival(self.dev, (arr,), self.dev.record(self.stream))


def _order(channel):
    src, dst, key = channel
    return src, dst, repr(key)          # one order on every rank, whatever the keys' types


def open_channels(mpi_comm, twin, wanted, opened: set) -> dict:
    """This rank's channels among `wanted`, (src, dst, key) triples every rank of mpi_comm passes alike
    (src == dst and those already in `opened` left out; `opened` gets the new ones): {triple: Channel}.

    Collective over mpi_comm: each sender makes its channels' unique ids, one allgather shares them, then
    every rank initialises the channels it is in in one order common to all ranks; NCCL's initialisation
    blocks until both ends join, and a common order leaves no cycle of ranks waiting on each other."""
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    new = {(s, d, k) for s, d, k in wanted if s != d} - opened
    uids = {c: twin.nccl.get_unique_id() for c in new if c[0] == rank}
    got = mpi_comm.allgather((frozenset(new), uids))
    for r, (theirs, _) in enumerate(got):      # checked on the gathered lists: every rank raises alike
        if theirs != got[0][0]:
            diff = sorted(theirs ^ got[0][0], key=_order)[:3]
            raise ValueError(f"open_channels on {size} ranks: rank {r} asked for other channels than rank 0 "
                             f"(first differences {diff}); every rank must pass the same list")
    bad = [c for c in new if not (0 <= c[0] < size and 0 <= c[1] < size)]
    if bad:
        raise ValueError(f"open_channels: channel {min(bad, key=_order)} names a rank outside 0..{size - 1}")
    for _, theirs in got:
        uids.update(theirs)
    opened |= new
    return {c: Channel(twin, uids[c], sending=c[0] == rank) for c in sorted(new, key=_order) if rank in c[:2]}
