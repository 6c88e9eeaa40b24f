"""The head-tail load-balanced split of a sequence over cp context-parallel ranks: T tokens are cut into
2 cp chunks of T / (2 cp) and rank r holds chunks r and 2 cp - 1 - r (PyTorch's _HeadTailLoadBalancer),
so under a causal mask every rank attends to the same number of query-key pairs. Positions are host
NumPy integers (metadata, never on the device); the arrays split and reassembled may be NumPy or CuPy.
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
