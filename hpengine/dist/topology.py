"""The device mesh: axes tp, cp, sharding, dp, pp with their degrees and order; rank <-> coordinates; every
communicator by name, each made once: one per axis, any product of axes ("dp*sharding"), an axis folded
inside others ("ep" of degree e inside dp*sharding, and its complement), and the tied-embedding pair. The
first axis in `order` is innermost (neighbouring ranks).
"""
from __future__ import annotations


from mpi4py import MPI

from hpengine.config.load import mesh_order
from hpengine.dist.comm import Comm
from hpengine.layout.resolve import AXES, TopologyError, resolve_degrees  # noqa: F401  (re-exported)

REPLICA = "replica"     # DiLoCo's axis: the islands, outermost


class Mesh:
    """Coordinates of every rank and one communicator per axis (ranks differing only along it)."""

    def __init__(self, world_comm, degrees: dict, order=AXES, wrap=None, node: dict | None = None):
        self.world = world_comm
        # this rank's place on its node (local rank, ranks on the node, BLAS threads, ...) as run/build.py
        # decided it; ranks.jsonl records it
        self.node = dict(node or {})
        self.rank, self.size = world_comm.Get_rank(), world_comm.Get_size()
        degrees = {"cp": 1, **degrees}
        islands = degrees.pop(REPLICA, 1)
        if islands < 1 or self.size % islands:
            raise TopologyError(f"{islands} DiLoCo islands: must be >= 1 and divide the world size {self.size}")
        # the replica axis is named only where there are islands: without DiLoCo the mesh is as it always was
        self.degrees = {**resolve_degrees(self.size // islands, degrees), **({REPLICA: islands} if islands > 1 else {})}
        order = mesh_order(order)
        if sorted(order) != sorted(AXES):
            raise TopologyError(f"mesh.order = {list(order)}: must be a permutation of {list(AXES)}")
        self.order = tuple(order)
        self.axes = self.order + ((REPLICA,) if islands > 1 else ())     # islands outermost: consecutive ranks
        self.strides, s = {}, 1
        for a in self.axes:
            self.strides[a] = s
            s *= self.degrees[a]
        self.coords = self.coords_of(self.rank)
        wrap = wrap or (lambda c, axis: c)
        self._wrap, self._folds, self._made = wrap, {}, []
        self.comms = {}
        for a in self.axes:  # same order of Split calls on every rank
            color = sum(self.coords[b] * self.strides[b] for b in self.axes if b != a)
            self.comms[a] = wrap(self._split(color, self.coords[a]), a)
        self.comms["tied"] = None
        if self.degrees["pp"] > 1:   # first and last pipeline stage: the tied embedding's two copies
            ends = self.coords["pp"] in (0, self.degrees["pp"] - 1)
            color = sum(self.coords[b] * self.strides[b] for b in self.axes if b != "pp") if ends else MPI.UNDEFINED
            c = self._split(color, self.coords["pp"])
            self.comms["tied"] = wrap(c, "tied") if ends else None

    def _split(self, color, key):
        c = self.world.Split(color, key)
        self._made.append(c)
        return c

    def free(self) -> None:
        """Free every communicator this mesh made (collective on the world: each rank frees the same ones in
        the same order). MPI has a few thousand communicators per process; a process that builds many
        engines (a test suite, a sweep) frees each mesh when done with it. The mesh is unusable after."""
        for c in self.comms.values():     # NCCL twins first, while their MPI communicators exist
            if isinstance(c, Comm):
                c.close()
        for c in self._made:
            if c != MPI.COMM_NULL:
                c.Free()
        self._made, self.comms = [], {}

    @staticmethod
    def group_name(axes) -> str:
        """The name of the product of `axes`, in mesh order (e.g. "dp*sharding")."""
        return "*".join(axes)

    def _product_color(self, axes) -> tuple[int, int]:
        """(colour, key) of this rank in the product of `axes`: ranks differing only along those axes share
        the colour; the key is the rank's index inside the product, innermost axis fastest."""
        color = sum(self.coords[b] * self.strides[b] for b in self.axes if b not in axes)
        key, s = 0, 1
        for a in self.order:
            if a in axes:
                key += self.coords[a] * s
                s *= self.degrees[a]
        return color, key

    def group(self, *axes: str):
        """The communicator of the ranks that differ only along `axes` (collective on the world the first
        time a product is asked for: every rank must ask for the same products in the same order).
        A single axis is that axis' communicator."""
        bad = [a for a in axes if a not in AXES]
        if bad or not axes or len(set(axes)) != len(axes):
            raise TopologyError(f"mesh group {list(axes)}: name distinct axes among {list(AXES)}")
        axes = tuple(a for a in self.order if a in axes)
        name = self.group_name(axes)
        if len(axes) == 1:
            return self.comms[axes[0]]
        if name not in self.comms:
            color, key = self._product_color(axes)
            self.comms[name] = self._wrap(self._split(color, key), name)
        return self.comms[name]

    def fold(self, name: str, degree: int, inside: tuple, across: tuple = ()):
        """An axis `name` of `degree` folded inside the product of `inside` (expert parallel inside
        dp*sharding): consecutive blocks of `degree` ranks of that product form one `name` group; the ranks
        at the same place in every block form its complement, "{name}-dp" (the replicas of a fold's share),
        which also spans the axes `across` (context parallel: every cp rank holds the same share too).
        Collective the first time; returns (the fold's communicator, its complement's)."""
        size = 1
        for a in inside:
            size *= self.degrees[a]
        if degree < 1 or size % degree:
            raise TopologyError(f"{name} degree {degree}: must divide the {self.group_name(inside)} ranks "
                                f"({size}); valid degrees: {[d for d in range(1, size + 1) if size % d == 0]}")
        if self._folds.setdefault(name, (degree, tuple(inside)))[0] != degree:
            raise TopologyError(f"{name} was folded with degree {self._folds[name][0]}; it cannot be folded "
                                f"again with degree {degree}")
        if name not in self.comms:
            color, key = self._product_color(tuple(a for a in self.order if a in inside))
            block, place = divmod(key, degree)
            self.comms[name] = self._wrap(self._split(color * size + block, place), name)
            wide, at = self._product_color(tuple(a for a in self.order if a in across))
            outer = sum(self.coords[b] * self.strides[b] for b in self.axes if b not in inside and b not in across)
            self.comms[f"{name}-dp"] = self._wrap(self._split(outer * degree + place, block + size // degree * at),
                                                 f"{name}-dp")
        return self.comms[name], self.comms[f"{name}-dp"]

    def groups_across_nodes(self, axis: str, hosts: list[str]) -> list[list[int]]:
        """The groups of `axis` (their world ranks, in order) whose ranks are on more than one node;
        hosts[r] names world rank r's node."""
        groups = {}
        for r in range(self.size):
            c = self.coords_of(r)
            groups.setdefault(tuple(c[b] for b in self.axes if b != axis), []).append(r)
        return [g for g in groups.values() if len({hosts[r] for r in g}) > 1]

    def needlessly_split(self, hosts: list[str], axes=("tp", "cp")) -> dict:
        """{axis: its groups that span nodes} for those of `axes` whose groups, with every axis inside
        them, could all lie inside a node (their product divides each node's ranks, hosts[r] naming world
        rank r's node) but do not: a launcher that interleaves the nodes' ranks."""
        per_node = [hosts.count(h) for h in set(hosts)]
        out, inner = {}, 1
        for a in self.order:
            inner *= self.degrees[a]
            if a in axes and self.degrees[a] > 1 and all(n % inner == 0 for n in per_node):
                split = self.groups_across_nodes(a, hosts)
                if split:
                    out[a] = split
        return out

    def coords_of(self, rank: int) -> dict:
        return {a: (rank // self.strides[a]) % self.degrees[a] for a in self.axes}

    def rank_of(self, coords: dict) -> int:
        return sum(coords.get(a, 0) * self.strides[a] for a in self.axes)

    @property
    def islands(self) -> int:
        return self.degrees.get(REPLICA, 1)

    def island(self):
        """The communicator of this rank's island (every inner axis; the world without DiLoCo). Collective on
        the world the first time."""
        if self.islands == 1:
            return self.world
        if "island" not in self.comms:
            color, key = self._product_color(self.order)
            self.comms["island"] = self._wrap(self._split(color, key), "island")
        return self.comms["island"]

    def prefix(self) -> str:
        c = self.coords
        cp = f" cp{c['cp']}" if self.degrees["cp"] > 1 else ""
        isl = f"i{c[REPLICA]} " if self.islands > 1 else ""
        return f"[r{self.rank} {isl}dp{c['dp']} sh{c['sharding']} pp{c['pp']} tp{c['tp']}{cp}]"

    def describe(self) -> str:
        return describe(self.degrees, self.axes if self.islands > 1 else self.order, self.size, self._folds)


FOLDED = {"ep": "the routed experts"}      # what a folded axis splits, for the mesh line


def describe(degrees: dict, order, size: int, folds: dict | None = None) -> str:
    """The mesh line of the start-up log: every axis with its degree, outermost first (cp only when on),
    the order, and each axis folded inside others ({name: (degree, inside axes)}, e.g. expert parallel)."""
    shown = [a for a in order if a != "cp" or degrees[a] > 1]
    degs = " x ".join(f"{a}={degrees[a]}" for a in reversed(shown))
    text = f"mesh {degs} (order innermost first: {', '.join(shown)}) on {size} ranks"
    for name, (degree, inside) in (folds or {}).items():
        if degree > 1:
            within = " x ".join(f"{a}={degrees[a]}" for a in reversed(order) if a in inside)
            text += (f"; {name}={degree} folded inside {within}: {FOLDED.get(name, 'its share')} split over "
                     f"each block of {degree} of those ranks (no extra ranks)")
    return text


def node_ranks(world) -> tuple[int, int]:
    """(rank, size) of this process among the ranks of `world` on its node (collective on world): the
    node-local rank picks the GPU. The node communicator is made and freed here, once, at start."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def node_gather(world, item) -> tuple[int, int, list]:
    """(rank, size) of this process among the ranks of `world` on its node, and every such rank's `item`
    (a small picklable object) in node-rank order: one allgather over the node (collective on world)."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        return node.Get_rank(), node.Get_size(), node.allgather(item)
    finally:
        node.Free()
