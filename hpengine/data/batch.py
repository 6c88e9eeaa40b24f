"""A batch of rows and everything that travels with them: tokens, targets, positions, document segments and
the loss mask, split together by every cut (replicas, gradient-merge passes, micro-batches, context-parallel
parts: head-tail per row, or per document when the rows pack documents). A field left None means its default (positions 0..T-1 in every row, one document per row, every
target counted), which keeps its split None; a rank that computes on no rows holds a Batch of only a shape.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hpengine.nn.context_split import chunk_size, document_split, split_sequence

FIELDS = ("tokens", "targets", "positions", "segments", "loss_mask", "ahead")


@dataclass(frozen=True)
class Batch:
    """(rows, T) arrays, any of them None; `shape` is (rows, T) whatever is present (required when nothing is).

    tokens: the model's input ids; targets: the ids it predicts; positions: each token's position (rotary
    angles, position embeddings; None: 0..T-1); segments: each token's document id within its row (None: one
    document per row); loss_mask: 1 where a target counts (None: every one); ahead: (rows, T, depth), the
    targets of multi-token prediction (with_ahead; None without it)."""
    tokens: object = None
    targets: object = None
    positions: object = None
    segments: object = None
    loss_mask: object = None
    ahead: object = None
    shape: tuple | None = None

    def __post_init__(self):
        arrays = {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}
        shapes = {tuple(a.shape) if f != "ahead" else tuple(a.shape[:2]) for f, a in arrays.items()}
        if len(shapes) > 1:
            raise ValueError(f"a batch's fields must share one (rows, T) shape; got {sorted(shapes)}")
        if shapes:
            got = shapes.pop()
            if "ahead" in arrays and arrays["ahead"].ndim != 3:
                raise ValueError(f"a batch's ahead is a (rows, T, depth) array; got {arrays['ahead'].shape}")
            if len(got) != 2 or (self.shape is not None and tuple(self.shape) != got):
                raise ValueError(f"a batch's fields are (rows, T) arrays; got {got} for a batch of shape {self.shape}")
            object.__setattr__(self, "shape", got)
        elif self.shape is None:
            raise ValueError("a batch with no arrays needs its shape (rows, T)")
        else:
            object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))

    @classmethod
    def empty(cls, rows: int, T: int) -> Batch:
        """The batch of a rank that reads no rows: its shape only (the pipeline's wire shapes come from it)."""
        return cls(shape=(rows, T))

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def seq_len(self) -> int:
        return self.shape[1]

    def present(self) -> dict:
        """The fields that hold arrays, by name, in FIELDS order."""
        return {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}

    def _with(self, fn, shape) -> Batch:
        return replace(self, **{f: fn(a) for f, a in self.present().items()}, shape=shape)

    def row_slice(self, start: int, stop: int) -> Batch:
        """Rows [start, stop) of every field (views, as slicing an array gives)."""
        if not 0 <= start <= stop <= self.rows:
            raise ValueError(f"rows [{start}, {stop}) are outside a batch of {self.rows} rows")
        return self._with(lambda a: a[start:stop], (stop - start, self.seq_len))

    def split_sequence(self, cp: int, rank: int) -> Batch:
        """This context-parallel rank's part of every row of every field (nn/context_split.py), on host arrays:
        the split comes before the move to the device. Rows of one document each (segments None): the
        head-tail part of the row; packed documents: the rank's columns of document_split, each document
        head-tail, with positions (filled with 0..T-1 if None), from which the attention masks."""
        if cp == 1:
            return self
        n = 2 * chunk_size(self.seq_len, cp)         # refuses, in one line, a T the 2 cp chunks do not divide
        if self.segments is None:
            return self._with(lambda a: split_sequence(np, a, cp, rank), (self.rows, n))
        cols = document_split(self.segments, cp)[:, rank * n:(rank + 1) * n]
        return self.default_positions()._with(
            lambda a: np.take_along_axis(a, cols.reshape(cols.shape + (1,) * (a.ndim - 2)), axis=1), (self.rows, n))

    def to_device(self, to_device) -> Batch:
        """Every field through `to_device` (a backend's: host arrays to the device's array module)."""
        return self._with(to_device, self.shape)

    def with_ahead(self, depth: int) -> Batch:
        """The batch with `ahead`, the targets of multi-token prediction, on host arrays before any sequence split
        (a target lies up to `depth` tokens past the row's own targets): ahead[r, i, k - 1] is the target of depth
        k at position i, the token k + 1 places after i, which is targets[r, i + k], or -1 where it does not count:
        past the row's end (the last k positions) or, with a loss mask, across a document boundary (a zero among
        loss_mask[r, i .. i + k]). Itself for depth 0 or a batch without targets."""
        if depth == 0 or self.targets is None:
            return self
        R, T = self.shape
        ok = np.ones(self.shape, dtype=bool) if self.loss_mask is None else np.asarray(self.loss_mask) != 0
        run, ahead = ok.copy(), np.full((R, T, depth), -1, dtype=np.int64)
        for k in range(1, min(depth, T - 1) + 1):
            run[:, :T - k] &= ok[:, k:]         # no boundary between i and i + k + 1
            ahead[:, :T - k, k - 1] = np.where(run[:, :T - k], self.targets[:, k:], -1)
        return replace(self, ahead=ahead)

    def default_positions(self) -> Batch:
        """positions filled with what None means, 0..T-1 in every row (int64)."""
        if self.positions is not None:
            return self
        pos = np.broadcast_to(np.arange(self.seq_len, dtype=np.int64), self.shape).copy()
        return replace(self, positions=pos)

    def defaults_only(self) -> bool:
        """Whether positions, segments and the loss mask are all their defaults (None)."""
        return self.positions is None and self.segments is None and self.loss_mask is None

