"""Flat parameter buffers: ParamSpec, Layout (offsets), FlatBuffer (one array + named views), Range,
and the ownership partition (the element-count partition of CN115114927A, or equal flat ranges).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class ParamSpec:
    """One tensor of a model: its global name and shape, the dim tensor parallelism splits
    (None = replicated) and whether a replicated one's gradient is partial over tp, whether weight decay
    applies, and how it is initialised."""
    name: str
    global_shape: tuple
    tp_dim: int | None = None
    decay: bool = True
    init: str = "normal"          # "normal" | "zeros" | "ones"
    std: float = 0.02
    block: str = ""               # the block that uses it: "embed", "h.3", "head", ...
    init_key: str = ""            # name the initial values are keyed on ("" = name)
    seed: int | None = None       # seed of the model it belongs to (None = the run's seed)
    true_shape: tuple | None = None   # unpadded shape when a dim is padded for tp (padding inits to 0)
    ep_dim: int | None = None     # the dim expert parallelism splits (a routed expert's weights: 0)
    # replicated (tp_dim None), but applied to this tp rank's heads only (a q/k norm): each rank's gradient
    # is its heads' part, summed over tp (layout/reduction.py)
    tp_partial: bool = False

    def tp_slices(self, tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1) -> tuple:
        """The global index slices this tp (and ep) rank holds (whole tensor when replicated)."""
        sl = [slice(0, n) for n in self.global_shape]
        for dim, rank, size, what in ((self.tp_dim, tp_rank, tp_size, "tensor_parallel"),
                                      (self.ep_dim, ep_rank, ep_size, "expert_parallel")):
            if dim is not None and size > 1:
                n = self.global_shape[dim]
                if n % size:
                    raise ValueError(f"tensor {self.name}: dim {dim} of size {n} is not divisible "
                                     f"by {what}.degree = {size}")
                k = n // size
                sl[dim] = slice(rank * k, (rank + 1) * k)
        return tuple(sl)

    def local_shape(self, tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1) -> tuple:
        return tuple(s.stop - s.start for s in self.tp_slices(tp_rank, tp_size, ep_rank, ep_size))


@dataclass(frozen=True)
class Range:
    """Half-open element range [start, stop) of a flat buffer."""
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def intersect(self, other: "Range") -> "Range | None":
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return Range(lo, hi) if lo < hi else None

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)


def packed(ranges) -> list[tuple[Range, int]]:
    """A rank's owned part of a flat buffer as (flat Range, its offset in the packed owned array): the disjoint
    `ranges` in flat order, adjacent ones joined, held one after another (one Range: offset 0)."""
    out, at = [], 0
    for r in sorted(ranges, key=lambda x: x.start):
        if out and out[-1][0].stop == r.start:
            out[-1] = (Range(out[-1][0].start, r.stop), out[-1][1])
        else:
            out.append((r, at))
        at += r.size
    return out


def cut(parts, r: Range) -> list[tuple[Range, int]]:
    """The pieces of flat Range r inside the owned `parts` (packed()): (flat Range, offset in the owned array)."""
    out = []
    for p, at in parts:
        hit = p.intersect(r)
        if hit is not None:
            out.append((hit, at + hit.start - p.start))
    return out


def subtract(r: Range, holes) -> list[Range]:
    """Range r less the disjoint Ranges `holes`, in flat order."""
    out, at = [], r.start
    for h in sorted(holes, key=lambda x: x.start):
        hit = h.intersect(r)
        if hit is None:
            continue
        if hit.start > at:
            out.append(Range(at, hit.start))
        at = hit.stop
    if at < r.stop:
        out.append(Range(at, r.stop))
    return out


# Parameters, gradients and optimizer moments of one model stage each live in one flat array that shares
# a Layout; per-tensor facts (shape, tensor-parallel dim, weight decay) live in the spec.
class Layout:
    """Assigns each spec (its local, tp- and ep-sliced shape) a contiguous offset, in declaration order."""

    def __init__(self, specs, tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1):
        self.specs = list(specs)
        self.tp_rank, self.tp_size, self.ep_rank, self.ep_size = tp_rank, tp_size, ep_rank, ep_size
        self.by_name = {}
        self.shapes, self.ranges = {}, {}
        off = 0
        for s in self.specs:
            if s.name in self.by_name:
                raise ValueError(f"duplicate parameter name {s.name!r}")
            shape = s.local_shape(tp_rank, tp_size, ep_rank, ep_size)
            self.by_name[s.name] = s
            self.shapes[s.name] = shape
            self.ranges[s.name] = Range(off, off + prod(shape))
            off += prod(shape)
        self.total = off

    def box(self, name: str) -> tuple:
        """The global index slices of tensor `name` this layout holds."""
        return self.by_name[name].tp_slices(self.tp_rank, self.tp_size, self.ep_rank, self.ep_size)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def expert_tensors(self) -> list[str]:
        """The tensors split over expert-parallel ranks (each rank holds other experts); none on one."""
        return [s.name for s in self.specs if s.ep_dim is not None and self.ep_size > 1]

    def expert_ranges(self) -> list[Range]:
        return [self.ranges[n] for n in self.expert_tensors]

    def tensors_in(self, r: Range):
        """(name, part of the flat range, offset inside the tensor) for every tensor meeting r."""
        for name in self.names:
            hit = self.ranges[name].intersect(r)
            if hit is not None:
                yield name, hit, hit.start - self.ranges[name].start


class FlatBuffer:
    """One flat array with a named view per tensor; views alias the array."""

    def __init__(self, layout: Layout, xp, dtype, data=None):
        self.layout = layout
        self.xp = xp
        self.data = xp.zeros(layout.total, dtype=dtype) if data is None else data
        if self.data.shape != (layout.total,):
            raise ValueError(f"flat buffer has shape {self.data.shape}, layout needs ({layout.total},)")
        self.views = {n: self.data[layout.ranges[n].slice].reshape(layout.shapes[n]) for n in layout.names}

    def __getitem__(self, name):
        return self.views[name]

    def __setitem__(self, name, value):
        # `G[name] += g` rebinds after the in-place add; the view already holds the result
        if value is not self.views[name]:
            self.views[name][...] = value

    def __contains__(self, name):
        return name in self.views

    def zero(self):
        self.data[...] = 0


def partition(sizes: list[int], n: int, mode: str = "tensor") -> list[Range]:
    """Split a flat buffer made of tensors of `sizes` (in layer order) into n owner ranges.

    "tensor": contiguous sets of whole tensors minimising the largest set (element count).
    "flat": equal element ranges that may cut tensors.
    """
    total = sum(sizes)
    if mode == "flat":
        bounds = [total * i // n for i in range(n + 1)]
        return [Range(bounds[i], bounds[i + 1]) for i in range(n)]
    if mode != "tensor":
        raise ValueError(f"partition = {mode!r}: valid values are 'tensor', 'flat'")
    if n > len(sizes):
        raise ValueError(f"sharding degree {n} exceeds the number of tensors ({len(sizes)}) with "
                         f"partition = 'tensor'; use a degree <= {len(sizes)} or partition = 'flat'")
    lo, hi = max(sizes), total
    while lo < hi:  # smallest capacity for which greedy packing needs <= n sets
        mid = (lo + hi) // 2
        if _greedy_sets(sizes, mid) <= n:
            hi = mid
        else:
            lo = mid + 1
    cuts = _greedy_cuts(sizes, lo)
    # fewer sets than owners: split the sets with most tensors (never raises the maximum)
    while len(cuts) - 1 < n:
        j = max(range(len(cuts) - 1), key=lambda i: cuts[i + 1] - cuts[i])
        cuts.insert(j + 1, cuts[j] + (cuts[j + 1] - cuts[j]) // 2)
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    return [Range(offs[cuts[i]], offs[cuts[i + 1]]) for i in range(n)]


def _greedy_sets(sizes, cap):
    return len(_greedy_cuts(sizes, cap)) - 1


def _greedy_cuts(sizes, cap):
    cuts, acc = [0], 0
    for i, s in enumerate(sizes):
        if acc + s > cap and acc > 0:
            cuts.append(i)
            acc = 0
        acc += s
    cuts.append(len(sizes))
    return cuts


def imbalance(ranges: list[Range]) -> float:
    """Largest share over mean share (1.0 = perfectly balanced)."""
    sizes = [r.size for r in ranges]
    mean = sum(sizes) / len(sizes)
    return max(sizes) / mean if mean else 1.0


def assign_owners(work: list[int], n: int) -> list[int]:
    """An owner in 0..n-1 for each item of `work` (whole tensors, each done on one owner), balancing the
    largest load: the heaviest item first to the least loaded owner, ties to the lower index (the same on
    every rank, whatever the order the items came in is)."""
    loads, out = [0] * n, [0] * len(work)
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        o = min(range(n), key=lambda k: (loads[k], k))
        out[i] = o
        loads[o] += work[i]
    return out


def load_imbalance(loads: list) -> float:
    """Largest load over mean load (1.0 = perfectly balanced)."""
    mean = sum(loads) / len(loads) if loads else 0
    return max(loads) / mean if mean else 1.0
