"""Buddy copies: every rank keeps its own state and a copy of another rank's (its partner's) in host memory,
the last two steps of each, so that a rank's death loses nothing: the spare that takes its place gets the
copy its buddy holds. Rank r's copy lives on rank (r + shift) mod n, shift chosen to cross nodes when it can.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

KEEP = 2        # generations kept: a rank is at most one step boundary ahead of another


def shift_of(hosts: list[str]) -> int:
    """The smallest shift s >= 1 with rank r's buddy (r + s) mod n on another node than r for every r (hosts[r]
    names rank r's node); 1 when no shift does (one node, or nodes of unequal rank counts)."""
    n = len(hosts)
    for s in range(1, n):
        if all(hosts[(r + s) % n] != hosts[r] for r in range(n)):
            return s
    return 1


def pack(arrays: dict, out: np.ndarray | None = None) -> tuple[list, np.ndarray]:
    """({name: host array}) -> (the arrays' (name, dtype, shape), their bytes in one uint8 buffer: `out` when it
    has the size, else a new one). One copy of each array."""
    meta = [(k, a.dtype.str, a.shape) for k, a in arrays.items()]
    size = sum(a.nbytes for a in arrays.values())
    data = out if out is not None and out.size == size else np.empty(size, np.uint8)
    at = 0
    for a in arrays.values():
        data[at:at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        at += a.nbytes
    return meta, data


def unpack(meta: list, data: np.ndarray) -> dict:
    """pack's inverse (views of data)."""
    out, at = {}, 0
    for name, dt, shape in meta:
        dt = np.dtype(dt)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        out[name] = data[at:at + n].view(dt).reshape(shape)
        at += n
    return out


class Buddies:
    """This rank's own state and its partner's copy, by step, over the compute communicator `comm` (raw
    mpi4py): `commit(step, arrays, facts)` after each step, `at(step)` for a recovery. `shift` from shift_of."""

    def __init__(self, comm, shift: int):
        self.comm, self.shift = comm, shift
        n, r = comm.Get_size(), comm.Get_rank()
        self.to, self.frm = (r + shift) % n, (r - shift) % n
        self.gens = {}          # step -> (own (meta, bytes, facts), partner's (meta, bytes, facts))

    def commit(self, step: int, arrays: dict, facts: dict) -> None:
        """Keep this rank's state after `step` steps and swap copies with the partners (collective: pairwise
        sends and receives over comm)."""
        # the generation that falls out lends its buffers: no fresh pages to fault in at every step
        spent = self.gens.pop(min(self.gens)) if len(self.gens) >= KEEP else None
        meta, data = pack(arrays, spent[0][1] if spent else None)
        mine = (meta, data, dict(facts))
        if self.comm.Get_size() == 1:
            theirs = mine
        else:
            head = self.comm.sendrecv((meta, data.size, mine[2]), dest=self.to, source=self.frm, sendtag=41,
                                      recvtag=41)
            buf = spent[1][1] if spent and spent[1][1].size == head[1] else np.empty(head[1], np.uint8)
            self.comm.Sendrecv([data, MPI.BYTE], dest=self.to, sendtag=42, recvbuf=[buf, MPI.BYTE],
                               source=self.frm, recvtag=42)
            theirs = (head[0], buf, head[2])
        self.gens[step] = (mine, theirs)
        for old in sorted(self.gens)[:-KEEP]:
            del self.gens[old]

    def latest(self) -> int:
        """The newest step this rank holds both copies of (-1: none yet)."""
        return max(self.gens, default=-1)

    def own(self, step: int):
        """(arrays, facts) of this rank at `step`."""
        meta, data, facts = self.gens[step][0]
        return unpack(meta, data), facts

    def partner(self, step: int):
        """(meta, bytes, facts) of the partner's state at `step` (what a spare in its place is sent)."""
        return self.gens[step][1]

    def nbytes(self) -> int:
        """Host bytes the copies hold."""
        return sum(c[1].nbytes for g in self.gens.values() for c in g)
