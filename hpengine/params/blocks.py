"""Quantisation blocks on whole tensors: block b of a tensor is its global row-major elements [b B, (b + 1) B) of the
unpadded shape, whatever the layout. Where a rank's pieces of a fragment's tensors (tp slices, sharding cuts) meet
those blocks ("runs": consecutive held values in one block), and the island chunks and payload bytes that follow.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

WINDOW = 1 << 22        # elements whose global positions are worked out at once (bounds the temporaries)


def tensor_blocks(spec, block: int) -> int:
    """Blocks of the whole (unpadded) tensor."""
    return -(-prod(spec.true_shape or spec.global_shape) // block)


def _positions(spec, box, lo: int, hi: int):
    """Global flat positions (in the unpadded shape) of local elements [lo, hi) of the box (slices of the global,
    possibly padded, shape), row-major; -1 where an element is tp padding."""
    local = tuple(s.stop - s.start for s in box)
    true = tuple(spec.true_shape or spec.global_shape)
    idx = np.unravel_index(np.arange(lo, hi, dtype=np.int64), local)
    real = np.ones(hi - lo, dtype=bool)
    glob = []
    for i, s, n in zip(idx, box, true):
        g = i + s.start
        real &= g < n
        glob.append(np.minimum(g, n - 1))
    pos = np.ravel_multi_index(glob, true) if glob else np.zeros(hi - lo, dtype=np.int64)
    return np.where(real, pos, -1)


def piece_runs(spec, box, lo: int, hi: int, block: int):
    """For local elements [lo, hi) of tensor `spec`'s box: (real: positions in [0, hi - lo) of the elements that are
    not tp padding, or None when all are; starts: each run's first element among the real ones; ids: its block).
    A run is a stretch of consecutive real elements in one block of the whole tensor."""
    starts, ids, keep, padded = [], [], [], False
    for a in range(lo, hi, WINDOW):
        pos = _positions(spec, box, a, min(hi, a + WINDOW))
        real = pos >= 0
        if not real.all():
            padded = True
        keep.append(np.flatnonzero(real) + (a - lo))
        b = pos[real] // block
        if b.size == 0:
            continue
        at = sum(k.size for k in keep[:-1])
        first = np.concatenate([[0], np.flatnonzero(np.diff(b)) + 1])
        if ids and ids[-1][-1] == b[0]:         # the run goes on across the window's edge
            first = first[1:]
        starts.append(first + at)
        ids.append(b[first])
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64))
    return (cat(keep) if padded else None), cat(starts), cat(ids)


@dataclass
class Plan:
    """One fragment's values on one rank (n of them, `segments` lengths, each within one tensor) laid over the
    fragment's `blocks` global blocks (its tensors' blocks one after another, in layout order): `real` the values
    that are not padding (None: all), and over those, runs (`starts`, block `ids`, strictly increasing)."""
    n: int
    segments: list
    blocks: int
    starts: np.ndarray
    ids: np.ndarray
    real: np.ndarray | None = None

    @property
    def m(self) -> int:
        """Values that are exchanged (not padding)."""
        return self.n if self.real is None else int(self.real.size)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(np.append(self.starts, self.m))

    def cuts(self, islands: int) -> list[tuple[int, int]]:
        """Island j's chunk: the runs (first, last + 1) of global blocks [blocks j / M, blocks (j + 1) / M)."""
        edges = np.searchsorted(self.ids, [self.blocks * j // islands for j in range(islands + 1)])
        return [(int(edges[j]), int(edges[j + 1])) for j in range(islands)]

    def block_span(self, j: int, islands: int) -> tuple[int, int]:
        """Island j's global blocks [first, last + 1)."""
        return self.blocks * j // islands, self.blocks * (j + 1) // islands

    def pieces(self, r0: int, r1: int) -> list[tuple[int, int, int]]:
        """The chunk of runs [r0, r1) cut at the segments' edges: (first value, values, runs) of each piece (values
        counted among the real ones)."""
        if r0 >= r1:
            return []
        at = self.starts[r0]
        stop = self.starts[r1] if r1 < self.starts.size else self.m
        out = []
        for e in self.segment_edges():
            if at < e and at < stop:
                end = min(e, stop)
                k = int(np.searchsorted(self.starts, end) - np.searchsorted(self.starts, at))
                out.append((int(at), int(end - at), k))
                at = end
        return out

    def segment_edges(self) -> list[int]:
        """Where each segment ends, among the real values."""
        ends = np.cumsum(self.segments, dtype=np.int64)
        if self.real is None:
            return [int(e) for e in ends]
        return [int(e) for e in np.searchsorted(self.real, ends)]

    def chunk_bytes(self, r0: int, r1: int, fmt: str, block: int) -> int:
        """Bytes of a chunk's payload: each piece's codes padded to whole blocks (a byte a value for int8, half for
        int4), then a float32 scale per run."""
        per = block if fmt == "int8" else block // 2
        return sum(-(-n // block) * per + 4 * k for _, n, k in self.pieces(r0, r1))

    def counts(self, fmt: str, islands: int, block: int) -> list[int]:
        """Bytes of every island's chunk of this rank's payload."""
        return [self.chunk_bytes(a, b, fmt, block) for a, b in self.cuts(islands)]


def fragment_plan(pieces, blocks: int, block: int) -> Plan:
    """The Plan of a fragment's pieces, in the order their values are laid out: (spec, box, lo, hi, base) each, the
    local elements [lo, hi) of a tensor whose blocks are numbered from `base` in the fragment."""
    segments, starts, ids, real, padded, at, kept = [], [], [], [], False, 0, 0
    for spec, box, lo, hi, base in pieces:
        keep, s, b = piece_runs(spec, box, lo, hi, block)
        segments.append(hi - lo)
        padded |= keep is not None
        keep = np.arange(hi - lo, dtype=np.int64) if keep is None else keep
        real.append(keep + at)
        starts.append(s + kept)
        ids.append(b + base)
        at, kept = at + hi - lo, kept + keep.size
    cat = (lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, dtype=np.int64))
    plan = Plan(at, segments, blocks, cat(starts), cat(ids), cat(real) if padded else None)
    if plan.ids.size and (np.any(np.diff(plan.ids) <= 0) or plan.ids[-1] >= blocks):
        raise ValueError("a fragment's pieces meet a block twice or out of order: every tensor must be held in one "
                         "piece per rank, in layout order, for its quantisation blocks")
    return plan


def whole(segments, block: int) -> Plan:
    """The Plan of whole tensors of these lengths (1-D), blocks from each one's start."""
    out, base = [], 0
    for n in segments:
        spec = _Flat((n,))
        out.append((spec, (slice(0, n),), 0, n, base))
        base += -(-n // block)
    return fragment_plan(out, base, block)


@dataclass(frozen=True)
class _Flat:
    global_shape: tuple
    true_shape: tuple | None = None
