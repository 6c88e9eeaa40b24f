"""The head-tail load-balanced split of a sequence over cp context-parallel ranks: T tokens are cut into 2 cp
chunks of T / (2 cp) and rank r holds chunks r and 2 cp - 1 - r (PyTorch's _HeadTailLoadBalancer), so under a
causal mask every rank attends to the same number of query-key pairs; packed documents are split head-tail per
document instead (document_split). Positions are host NumPy integers; the arrays split may be NumPy or CuPy.
"""
from __future__ import annotations

import numpy as np


def check_split(T: int, cp: int) -> None:
    """Refuse, in one line, a sequence length that the 2 cp chunks do not divide."""
    if cp < 1:
        raise ValueError(f"context parallelism needs a degree of at least 1, got {cp}")
    n = 2 * cp
    if T % n:
        lo, hi = (T // n) * n, (T // n + 1) * n
        fits = f"{lo} or {hi}" if lo else f"{hi}"
        raise ValueError(f"context parallel degree {cp} cuts each sequence into 2 x {cp} = {n} chunks: "
                         f"seq_len {T} is not divisible by {n} (use a multiple of {n}, e.g. {fits})")


def chunk_size(T: int, cp: int) -> int:
    """Tokens per chunk, T / (2 cp)."""
    check_split(T, cp)
    return T // (2 * cp)


def chunks_of(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks rank holds, head first: (rank, 2 cp - 1 - rank)."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside the context-parallel group of {cp}")
    return rank, 2 * cp - 1 - rank


def head_tail_positions(T: int, cp: int, rank: int) -> np.ndarray:
    """Global positions (int64, ascending) of the T / cp tokens rank holds of each sequence: for position
    embeddings, rotary angles and the causal mask."""
    c = chunk_size(T, cp)
    head, tail = chunks_of(cp, rank)
    return np.concatenate([np.arange(head * c, (head + 1) * c), np.arange(tail * c, (tail + 1) * c)])


def contiguous_positions(T: int, cp: int, rank: int) -> np.ndarray:
    """The positions of a plain contiguous split (rank r holds [r T/cp, (r+1) T/cp)), for comparison."""
    if T % cp:
        raise ValueError(f"seq_len {T} is not divisible by the context parallel degree {cp}")
    n = T // cp
    return np.arange(rank * n, (rank + 1) * n)


def split_sequence(xp, x, cp: int, rank: int):
    # x: (B, T, ...) -> (B, T / cp, ...): rank's head chunk then its tail chunk (a new array)
    T = x.shape[1]
    c = chunk_size(T, cp)
    head, tail = chunks_of(cp, rank)
    return xp.concatenate([x[:, head * c:(head + 1) * c], x[:, tail * c:(tail + 1) * c]], axis=1)


def gather_head_tail(xp, parts):
    # parts: every rank's (B, T / cp, ...) in rank order -> (B, T, ...), the sequence whole again
    cp = len(parts)
    B, n = parts[0].shape[:2]
    if n % 2:
        raise ValueError(f"a head-tail part holds two equal chunks; got {n} tokens")
    c = n // 2
    out = xp.empty((B, n * cp) + tuple(parts[0].shape[2:]), dtype=parts[0].dtype)
    for r, part in enumerate(parts):
        if part.shape != parts[0].shape:
            raise ValueError(f"rank {r}'s part has shape {part.shape}, rank 0's {parts[0].shape}")
        head, tail = chunks_of(cp, r)
        out[:, head * c:(head + 1) * c] = part[:, :c]
        out[:, tail * c:(tail + 1) * c] = part[:, c:]
    return out


def causal_products(positions) -> int:
    """Query-key products a rank's queries take under a causal mask over the whole sequence: the query at
    position p sees keys 0..p, p + 1 of them."""
    p = np.asarray(positions, dtype=np.int64)
    return int((p + 1).sum())


def document_work(positions, cp: int) -> np.ndarray:
    """Query-key pairs each cp rank's queries see under a document mask when every packed row is split
    head-tail: positions (rows, T) each token's position within its document (a query at p sees p + 1 keys)
    -> (cp,) int64. The causal balance of the head-tail split does not hold per document: a row's long
    documents dominate, wherever their chunks fall."""
    p = np.asarray(positions, dtype=np.int64)
    return np.array([int((p[:, head_tail_positions(p.shape[1], cp, r)] + 1).sum()) for r in range(cp)],
                    dtype=np.int64)


# Packed documents. A document of L = 2 cp q + m tokens (m < 2 cp) leaves its first m tokens aside and splits
# the other L - m head-tail in 2 cp chunks of q: the work of a query is its position within its document + 1,
# an arithmetic run over those tokens, so chunks r and 2 cp - 1 - r weigh the same for every r and each rank
# gets the same work and 2 q tokens of the document. The row's set-aside tokens (the cheapest of each document)
# are sorted by work, heaviest first, and dealt head-tail too (in each 2 cp of them, rank r takes the r-th
# and the (2 cp - 1 - r)-th): every rank gets the same count and nearly the same work. No padding, no
# communication: the rule reads only the row's segments.
def _row_split(seg: np.ndarray, cp: int) -> np.ndarray:
    # seg (T,) one row's document ids (contiguous runs) -> (T,) the rank of every token
    T, n = seg.size, 2 * cp
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    lengths = np.diff(np.r_[starts, T])
    run = np.repeat(np.arange(starts.size), lengths)
    offset = np.arange(T) - starts[run]                   # position within the run: its work is offset + 1
    m, q = lengths % n, lengths // n
    rest = offset >= m[run]
    chunk = np.zeros(T, dtype=np.int64)
    chunk[rest] = (offset[rest] - m[run][rest]) // q[run][rest]
    aside = np.flatnonzero(~rest)
    order = aside[np.argsort(-offset[aside], kind="stable")]
    chunk[order] = np.arange(order.size) % n
    return np.minimum(chunk, n - 1 - chunk)


def document_ranks(segments, cp: int) -> np.ndarray:
    """The cp rank of every token of packed rows: segments (rows, T) each token's document id within its
    row, documents contiguous runs -> (rows, T) int64 in [0, cp), each rank T / cp tokens of every row."""
    seg = np.asarray(segments, dtype=np.int64)
    chunk_size(seg.shape[1], cp)
    if cp == 1:
        return np.zeros(seg.shape, dtype=np.int64)
    return np.stack([_row_split(row, cp) for row in seg]) if seg.shape[0] else np.zeros(seg.shape, np.int64)


def document_split(segments, cp: int) -> np.ndarray:
    """Every row's columns in rank order: (rows, T) int64 whose columns [r T / cp, (r + 1) T / cp) are the
    tokens rank r holds (document_ranks), ascending within a rank (row order, so a rank's tokens of one
    document stay in document order). A rank's part of a field a (rows, T) is take_along_axis(a, split[:,
    r T / cp:(r + 1) T / cp], axis=1)."""
    ranks = document_ranks(segments, cp)
    return np.argsort(ranks, axis=1, kind="stable")


def split_work(segments, positions, cp: int) -> np.ndarray:
    """Query-key pairs each cp rank's queries see under the document mask with document_split: positions
    (rows, T) each token's position within its document (a query at p sees p + 1 keys) -> (cp,) int64, to
    set beside document_work (the head-tail split of every packed row)."""
    ranks = document_ranks(segments, cp)
    w = np.asarray(positions, dtype=np.int64) + 1
    return np.array([int(w[ranks == r].sum()) for r in range(cp)], dtype=np.int64)


def imbalance(work) -> float:
    """Busiest rank's work over the mean (1.0 for no work)."""
    w = np.asarray(work, dtype=np.float64)
    return float(w.max() / w.mean()) if w.size and w.mean() > 0 else 1.0
