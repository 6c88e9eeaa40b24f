"""Packed documents: what a window of tokens knows of the documents it crosses, from the token file's
document offsets alone (no token is read). Per row: each token's document id within the row, its position
within its document (a window that starts inside a document counts that piece from 0), and the loss mask
that drops the predictions across a boundary; and the count of counted targets, the loss divisor.
"""
from __future__ import annotations

import numpy as np


def offsets_of(tf) -> np.ndarray:
    """A file's document offsets; a file without them (version 1) is one document."""
    d = tf.doc_offsets
    return np.array([0, tf.n_tokens], dtype=np.int64) if d is None else d


def window_documents(offsets: np.ndarray, starts: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(segments, positions, loss_mask), (rows, T) int64 each, of the windows whose input tokens are
    [s, s + T) of the file (targets [s + 1, s + T + 1)), s in `starts` (absolute token indices)."""
    starts = np.asarray(starts, dtype=np.int64).reshape(-1, 1)
    t = starts + np.arange(T + 1, dtype=np.int64)                   # every token of the window, targets included
    doc = np.searchsorted(offsets, t, side="right") - 1             # the document each token belongs to
    segments = doc[:, :T] - doc[:, :1]
    positions = t[:, :T] - np.maximum(offsets[doc[:, :T]], starts)
    loss_mask = (doc[:, 1:] == doc[:, :T]).astype(np.int64)        # a target in the input token's document
    return segments, positions, loss_mask


def counted_targets(offsets: np.ndarray, starts: np.ndarray, T: int) -> int:
    """The ones of window_documents' loss masks, summed over the windows: T per window less the document
    starts among its targets (offsets in (s, s + T])."""
    starts = np.asarray(starts, dtype=np.int64)
    crossed = np.searchsorted(offsets, starts + T, side="right") - np.searchsorted(offsets, starts, side="right")
    return int(T * starts.size - crossed.sum())


def counted_ahead(offsets: np.ndarray, starts: np.ndarray, T: int, k: int) -> int:
    """The targets multi-token prediction's depth k counts in the windows (data.Batch.with_ahead): positions i < T - k
    whose token i + k + 1 of the window lies in the document of token i."""
    if k >= T:
        return 0
    t = np.asarray(starts, dtype=np.int64).reshape(-1, 1) + np.arange(T + 1, dtype=np.int64)
    doc = np.searchsorted(offsets, t, side="right")
    return int((doc[:, :T - k] == doc[:, k + 1:]).sum())


def length_summary(offsets: np.ndarray) -> str:
    """The document-length distribution: count, mean, median, p99 and the longest, in tokens."""
    n = np.diff(np.asarray(offsets, dtype=np.int64))
    if n.size == 0:
        return "no documents"
    return (f"{n.size:,} documents: mean {n.mean():,.1f}, median {np.median(n):,.0f}, "
            f"p99 {np.percentile(n, 99):,.0f}, longest {int(n.max()):,} tokens")
