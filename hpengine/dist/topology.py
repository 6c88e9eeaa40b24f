"""The device mesh: axes tp, sharding, dp, pp with their degrees and order; rank <-> coordinates;
every Comm.Split, made once. The first axis in `order` is innermost (neighbouring ranks).
"""
from __future__ import annotations


from mpi4py import MPI

from hpengine.layout.resolve import AXES, TopologyError, resolve_degrees  # noqa: F401  (re-exported)


class Mesh:
    """Coordinates of every rank and one communicator per axis (ranks differing only along it)."""

    def __init__(self, world_comm, degrees: dict, order=AXES, wrap=None):
        self.world = world_comm
        self.rank, self.size = world_comm.Get_rank(), world_comm.Get_size()
        self.degrees = resolve_degrees(self.size, degrees)
        if sorted(order) != sorted(AXES):
            raise TopologyError(f"mesh.order = {list(order)}: must be a permutation of {list(AXES)}")
        self.order = tuple(order)
        self.strides, s = {}, 1
        for a in self.order:
            self.strides[a] = s
            s *= self.degrees[a]
        self.coords = self.coords_of(self.rank)
        wrap = wrap or (lambda c, axis: c)
        self.comms = {}
        for a in self.order:  # same order of Split calls on every rank
            color = sum(self.coords[b] * self.strides[b] for b in AXES if b != a)
            self.comms[a] = wrap(world_comm.Split(color, self.coords[a]), a)
        self.comms["tied"] = None
        if self.degrees["pp"] > 1:   # first and last pipeline stage: the tied embedding's two copies
            ends = self.coords["pp"] in (0, self.degrees["pp"] - 1)
            color = sum(self.coords[b] * self.strides[b] for b in AXES if b != "pp") if ends else MPI.UNDEFINED
            c = world_comm.Split(color, self.coords["pp"])
            self.comms["tied"] = wrap(c, "tied") if ends else None

    def coords_of(self, rank: int) -> dict:
        return {a: (rank // self.strides[a]) % self.degrees[a] for a in AXES}

    def rank_of(self, coords: dict) -> int:
        return sum(coords[a] * self.strides[a] for a in AXES)

    def prefix(self) -> str:
        c = self.coords
        return f"[r{self.rank} dp{c['dp']} sh{c['sharding']} pp{c['pp']} tp{c['tp']}]"

    def describe(self) -> str:
        degs = " x ".join(f"{a}={self.degrees[a]}" for a in reversed(self.order))
        return f"mesh {degs} (order innermost first: {', '.join(self.order)}) on {self.size} ranks"


def node_ranks(world) -> tuple[int, int]:
    """(rank, size) of this process among the ranks of `world` on its node (collective on world): the
    node-local rank picks the GPU. The node communicator is made and freed here, once, at start."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()
