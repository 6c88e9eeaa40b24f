"""Causal attention of a rank's queries against one block of keys and values at a time, for context
parallelism (strategies/context_parallel.py walks the blocks around the ring, or gathers them): block
forward and backward, masked by global positions (and, for packed documents, by each row's document
segments and per-row positions within them), and `merge_partials` of the partial outputs.
"""
from __future__ import annotations

import math
from itertools import pairwise

import numpy as np


# Half precision computes in float32.
def accumulate_dtype(dtype):
    """The dtype the block math runs in: the array's, float32 for half precision."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


# The mask comes from global positions (query at p sees keys at positions <= p), so any split of the
# sequence works; positions are host int arrays, (T,) shared by every row, or (B, T) per row (packed documents
# split per document: each token's position within its document, with the segments).
def host_positions(pos) -> np.ndarray:
    """Positions as a host int64 array, (T,) or per row (B, T) (a device array is copied down)."""
    if hasattr(pos, "__cuda_array_interface__"):
        pos = pos.get()
    pos = np.asarray(pos, dtype=np.int64)
    return pos if pos.ndim == 2 else pos.reshape(-1)


def host_segments(seg):
    """Document segments (B, T) as a host int64 array, or None (one document per row)."""
    if seg is None:
        return None
    if hasattr(seg, "__cuda_array_interface__"):
        seg = seg.get()
    return np.asarray(seg, dtype=np.int64)


# A row's documents are contiguous runs of its packed sequence, so a key at position kp of document d is
# seen by some query iff kp <= the last query position of document d; per row, from one scatter-max.
def _reach(qp, kp, qs, ks) -> np.ndarray:
    # (B, Tk) True where some query of the key's own document sits at or after it; qp, kp (T,) or (B, T)
    B = qs.shape[0]
    n = int(max(qs.max(), ks.max())) + 1
    last = np.full((B, n), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(last, (np.arange(B)[:, None], qs), np.broadcast_to(qp, qs.shape))
    return np.broadcast_to(kp, ks.shape) <= np.take_along_axis(last, ks, axis=1)


def _row_segments(qp, kp, qs, ks):
    # per-row positions without segments: one document per row
    if qs is None and (qp.ndim == 2 or kp.ndim == 2):
        B = qp.shape[0] if qp.ndim == 2 else kp.shape[0]
        return np.zeros((B, qp.shape[-1]), np.int64), np.zeros((B, kp.shape[-1]), np.int64)
    return qs, ks


def block_visible(q_pos, k_pos, q_seg=None, k_seg=None) -> bool:
    """Whether any query at q_pos sees any key at k_pos (some key position <= some query position); with
    segments (B, Tq), (B, Tk), only a key of the query's own document in its row counts."""
    q_pos, k_pos = host_positions(q_pos), host_positions(k_pos)
    if not (q_pos.size and k_pos.size and k_pos.min() <= q_pos.max()):
        return False
    qs, ks = _row_segments(q_pos, k_pos, host_segments(q_seg), host_segments(k_seg))
    if qs is None:
        return True
    return bool(_reach(q_pos, k_pos, qs, ks).any())


# Grouped-query:
# q (B, H, Tq, hd) over k, v (B, K, Tk, hd), the g = H / K heads of a group folded into the rows of one
# GEMM, so keys and values are never repeated per head.
def _groups(H: int, K: int) -> int:
    if H % K:
        raise ValueError(f"{H} query heads do not split into groups of {K} key/value heads")
    return H // K


# Runs of consecutive positions are tiles; a tile
# whose every key lies after every query is skipped. Per-row positions have no common runs: a block is cut in
# two halves (the two chunks a head-tail block has), a tile skipped when no row has a visible pair in it.
def _runs(pos: np.ndarray):
    # index ranges [i, j) of pos holding consecutive ascending positions; (B, T): the two halves
    if pos.ndim == 2:
        half = (pos.shape[1] + 1) // 2
        return [(a, b) for a, b in ((0, half), (half, pos.shape[1])) if b > a]
    edges = [0, *(np.flatnonzero(np.diff(pos) != 1) + 1).tolist(), len(pos)]
    return [(a, b) for a, b in pairwise(edges) if b > a]


def _row_mask(xp, qp, kp, qs, ks):
    # per-row positions (B, n) or (n,), (B, m) or (m,) with segments (B, n), (B, m) -> (B, 1, 1, n, m) or None
    qp2, kp2 = np.broadcast_to(qp, qs.shape), np.broadcast_to(kp, ks.shape)
    m = (kp2[:, None, :] > qp2[:, :, None]) | (qs[:, :, None] != ks[:, None, :])
    return xp.asarray(m[:, None, None]) if m.any() else None


def _mask(xp, qp, kp, qs=None, ks=None):
    # (n, m) True where the key comes after the query; None when every key is visible. With segments (host
    # (B, n), (B, m)): (B, 1, 1, n, m), also True where the key lies in another document of the row
    if qp.ndim == 2 or kp.ndim == 2:
        return _row_mask(xp, qp, kp, *_row_segments(qp, kp, qs, ks))
    if qs is not None and not ((qs == qs[:, :1]).all() and (ks == qs[:, :1]).all()):
        other = qs[:, :, None] != ks[:, None, :]
        if kp.max() > qp.min():
            other |= kp[None, None, :] > qp[None, :, None]
        return xp.asarray(other[:, None, None])
    if kp.max() <= qp.min():
        return None
    return xp.asarray(kp)[None, :] > xp.asarray(qp)[:, None]


def _tile_mask(xp, qp, kp, qs, ks, a, b, c, d):
    if qs is None:
        return _mask(xp, qp[..., a:b], kp[..., c:d])
    return _mask(xp, qp[..., a:b], kp[..., c:d], qs[:, a:b], ks[:, c:d])


def _tile_seen(qp, kp, qs, ks, a, b, c, d) -> bool:
    # whether tile (queries a..b-1, keys c..d-1) has a visible pair; a skipped tile is one whose every pair
    # is masked, so skipping it changes nothing (its merge would add o = 0 at lse = -inf)
    if qp.ndim == 2 or kp.ndim == 2:
        qs, ks = _row_segments(qp, kp, qs, ks)
        return bool(_reach(qp[..., a:b], kp[..., c:d], qs[:, a:b], ks[:, c:d]).any())
    if kp[c] > qp[b - 1]:
        return False
    return qs is None or bool(_reach(qp[a:b], kp[c:d], qs[:, a:b], ks[:, c:d]).any())


def _masked_scores(xp, qt, kt, mask, n):
    # qt (B, K, g*n, hd) scaled, kt (B, K, m, hd) -> scores (B, K, g*n, m), -inf where masked
    s = xp.matmul(qt, kt.swapaxes(-1, -2))
    if mask is None:
        return s
    B, K, R, m = s.shape
    return xp.where(mask, -xp.inf, s.reshape(B, K, R // n, n, m)).reshape(B, K, R, m)


def _safe(xp, a, bad, fill):
    return xp.where(bad, fill, a)


# Each block gives a partial output and its row
# log-sum-exp, and partials combine by `merge` (the online softmax).
def merge_partials(xp, o, lse, o2, lse2):
    """Combine two partial attentions over disjoint key sets: o, o2 (..., n, hd) each normalised over
    its own keys, lse, lse2 (..., n) their row log-sum-exps -> (o, lse) over the union. A row that saw
    no key has lse -inf and weighs nothing; two such rows stay o = 0, lse = -inf (no NaN)."""
    m = xp.maximum(lse, lse2)
    m = _safe(xp, m, xp.isneginf(m), 0.0)
    w1, w2 = xp.exp(lse - m), xp.exp(lse2 - m)
    w = w1 + w2
    empty = w == 0
    ws = _safe(xp, w, empty, 1.0)
    out = (o * (w1 / ws)[..., None] + o2 * (w2 / ws)[..., None])
    return out, _safe(xp, m + xp.log(ws), empty, -xp.inf)


def _tile_forward(xp, qt, kt, vt, mask, n):
    # one tile: -> o (B, K, g*n, hd) normalised over its keys, lse (B, K, g*n), and each row's largest visible
    # score (B, K, g*n, 1) (-inf for a row that sees no key of the tile), which MuonClip reads
    s = _masked_scores(xp, qt, kt, mask, n)
    row_max = s.max(axis=-1, keepdims=True)
    mx = _safe(xp, row_max, xp.isneginf(row_max), 0.0)      # a row with no visible key: exp(-inf - 0) = 0
    s -= mx
    p = xp.exp(s, out=s)
    lsum = p.sum(axis=-1, keepdims=True)
    empty = lsum == 0
    ls = _safe(xp, lsum, empty, 1.0)
    o = xp.matmul(p, vt) / ls
    return o, _safe(xp, mx + xp.log(ls), empty, -xp.inf)[..., 0], row_max


def _scale(hd, scale):
    return 1.0 / math.sqrt(hd) if scale is None else float(scale)


def _rows(a5, a, b, ct):
    # rows a..b-1 of a (B, K, g, T, ...) view -> (B, K, g*(b-a), ...) in dtype ct
    B, K, g = a5.shape[:3]
    return a5[:, :, :, a:b].astype(ct).reshape((B, K, g * (b - a)) + tuple(a5.shape[4:]))


def _block_facts(q, k, q_pos, k_pos, scale):
    """What a block's forward and backward both start from: the shapes, the query groups per key head, the
    compute dtype, the score scale and the positions on the host (checked against the shapes)."""
    B, H, Tq, hd = q.shape
    K, Tk = k.shape[1], k.shape[2]
    qp, kp = host_positions(q_pos), host_positions(k_pos)
    if qp.shape not in ((Tq,), (B, Tq)) or kp.shape not in ((Tk,), (B, Tk)):
        raise ValueError(f"query positions {qp.shape} for {B} rows of {Tq} queries, key positions {kp.shape} for "
                         f"{Tk} keys: give (T,) or (rows, T)")
    return B, H, Tq, hd, K, Tk, _groups(H, K), accumulate_dtype(q.dtype), _scale(hd, scale), qp, kp


def _block_segments(q_seg, k_seg, B, Tq, Tk):
    # host (B, Tq), (B, Tk) segments, or (None, None); both or neither
    if (q_seg is None) != (k_seg is None):
        raise ValueError("segments for the queries and the keys go together: give both or neither")
    qs, ks = host_segments(q_seg), host_segments(k_seg)
    if qs is not None and (qs.shape != (B, Tq) or ks.shape != (B, Tk)):
        raise ValueError(f"segments {qs.shape} and {ks.shape} for {B} rows of {Tq} queries and {Tk} keys")
    return qs, ks


def block_forward(xp, q, k, v, q_pos, k_pos, scale=None, q_seg=None, k_seg=None, logit_max=False):
    """Attention of the queries over one block of keys: q (B, H, Tq, hd), k, v (B, K, Tk, hd), q_pos
    (Tq,), k_pos (Tk,) global positions (or (B, Tq), (B, Tk) per row) -> o (B, H, Tq, hd) normalised over this block's visible keys and
    lse (B, H, Tq), in accumulate_dtype; a row that sees none of the block has o = 0, lse = -inf. The scores
    are scale * q k^T, scale 1/sqrt(hd) unless given (1.0 for a q already scaled). q_seg (B, Tq), k_seg
    (B, Tk): each token's document in its row (packed documents; None: one per row), a query sees only keys
    of its own; a tile no query-key pair of one document spans is skipped. logit_max: also return each head's
    largest score over the visible pairs (H,) (-inf for a head that sees none), taken from the tiles' row maxima
    the softmax forms anyway (MuonClip's measurement)."""
    B, H, Tq, hd, K, Tk, g, ct, sc, qp, kp = _block_facts(q, k, q_pos, k_pos, scale)
    qs, ks = _block_segments(q_seg, k_seg, B, Tq, Tk)
    o5 = xp.zeros((B, K, g, Tq, hd), dtype=ct)
    lse5 = xp.full((B, K, g, Tq), -xp.inf, dtype=ct)
    best = xp.full((K, g), -xp.inf, dtype=ct) if logit_max else None
    q5 = q.reshape(B, K, g, Tq, hd)
    kruns = _runs(kp)
    for a, b in _runs(qp):
        qt, acc = None, None
        for c, d in kruns:
            if not _tile_seen(qp, kp, qs, ks, a, b, c, d):      # e.g. every key after every query
                continue
            if qt is None:
                qt = _rows(q5, a, b, ct) * sc
            *part, row_max = _tile_forward(xp, qt, k[:, :, c:d].astype(ct), v[:, :, c:d].astype(ct),
                                           _tile_mask(xp, qp, kp, qs, ks, a, b, c, d), b - a)
            acc = part if acc is None else merge_partials(xp, *acc, *part)
            if best is not None:
                best = xp.maximum(best, row_max.reshape(B, K, g, b - a).max(axis=(0, 3)))
        if acc is not None:
            o5[:, :, :, a:b] = acc[0].reshape(B, K, g, b - a, hd)
            lse5[:, :, :, a:b] = acc[1].reshape(B, K, g, b - a)
    out = o5.reshape(B, H, Tq, hd), lse5.reshape(B, H, Tq)
    return out if best is None else (*out, best.reshape(H))


def softmax_delta(xp, o, do):
    """D = rowsum(dO * O) (B, H, Tq) of the final output, in accumulate_dtype: it stands for rowsum(dP * P)
    in every block's softmax backward."""
    ct = accumulate_dtype(o.dtype)
    return (do.astype(ct) * o.astype(ct)).sum(axis=-1)


# Backward is FlashAttention-2's per
# block: from the final o and lse, p = exp(s - lse), D = rowsum(dO * O), dS = P (dP - D).
def block_backward(xp, q, k, v, o, lse, do, q_pos, k_pos, scale=None, delta=None, q_seg=None, k_seg=None):
    """One block's share of the gradients, given the final o (B, H, Tq, hd), lse (B, H, Tq) over all
    keys and do (B, H, Tq, hd): -> dq (B, H, Tq, hd) this block's contribution, dk, dv (B, K, Tk, hd) the
    gradients of this block's keys and values from these queries, in accumulate_dtype. delta is
    softmax_delta(xp, o, do), computed here when not given (once per query set is enough); q_seg, k_seg
    the documents as block_forward's."""
    B, H, Tq, hd, K, Tk, g, ct, sc, qp, kp = _block_facts(q, k, q_pos, k_pos, scale)
    qs, ks = _block_segments(q_seg, k_seg, B, Tq, Tk)
    if delta is None:
        delta = softmax_delta(xp, o, do)
    lse = lse.astype(ct)
    lse = _safe(xp, lse, xp.isneginf(lse), xp.inf)     # a row that saw no key anywhere: p = 0
    q5, do5 = q.reshape(B, K, g, Tq, hd), do.reshape(B, K, g, Tq, hd)
    lse5, dd5 = lse.reshape(B, K, g, Tq, 1), delta.reshape(B, K, g, Tq, 1)
    dq5 = xp.zeros((B, K, g, Tq, hd), dtype=ct)
    dk, dv = xp.zeros((B, K, Tk, hd), dtype=ct), xp.zeros((B, K, Tk, hd), dtype=ct)
    kruns = _runs(kp)
    for a, b in _runs(qp):
        tiles = [(c, d) for c, d in kruns if _tile_seen(qp, kp, qs, ks, a, b, c, d)]
        if not tiles:
            continue
        qt, dot = _rows(q5, a, b, ct) * sc, _rows(do5, a, b, ct)
        lt, ddt = _rows(lse5, a, b, ct), _rows(dd5, a, b, ct)
        dqt = xp.zeros_like(qt)
        for c, d in tiles:
            kt, vt = k[:, :, c:d].astype(ct), v[:, :, c:d].astype(ct)
            s = _masked_scores(xp, qt, kt, _tile_mask(xp, qp, kp, qs, ks, a, b, c, d), b - a)
            s -= lt
            p = xp.exp(s, out=s)
            dv[:, :, c:d] += xp.matmul(p.swapaxes(-1, -2), dot)
            ds = xp.matmul(dot, vt.swapaxes(-1, -2))
            ds -= ddt
            ds *= p
            dqt += xp.matmul(ds, kt)
            dk[:, :, c:d] += xp.matmul(ds.swapaxes(-1, -2), qt)     # qt is scaled: dk needs no factor
        dq5[:, :, :, a:b] = dqt.reshape(B, K, g, b - a, hd) * sc
    return dq5.reshape(B, H, Tq, hd), dk, dv


def ring_cache_elements(B: int, Tq: int, H: int, K: int, hd: int) -> int:
    """Elements a ring forward keeps per rank for its backward: q and o (H heads), this rank's k and v
    (K heads) and one lse per query head and position; no other rank's keys and no score."""
    return B * Tq * (hd * (2 * H + 2 * K) + H)


def allgather_cache_elements(B: int, Tq: int, H: int, K: int, hd: int, cp: int) -> int:
    """Elements an all-gather forward keeps per rank: q, o and lse as the ring, and every rank's k and v
    (gathered once in forward, read again by backward)."""
    return B * Tq * (hd * (2 * H + 2 * K * cp) + H)


def context_cache_bytes(B: int, Tq: int, H: int, K: int, hd: int, item: int, cp: int, comm: str = "ring") -> int:
    """Bytes one layer's attention keeps under context parallelism (strategies/context_attention.py): the
    driver's cache (ring_cache_elements or allgather_cache_elements, the lse in float32 at least), the heads
    merged back into (B, Tq, H hd) for the output projection, and the host int64 positions of the key blocks
    held (the ring: the cp - 1 received ones; the all-gather: all of them). The merge is a view, no copy,
    with one head (or one token) per rank. The rank's own positions are shared by every layer of a chunk
    (context_positions_bytes)."""
    heads = ring_cache_elements(B, Tq, H, K, hd) if comm == "ring" else allgather_cache_elements(B, Tq, H, K, hd, cp)
    lse = B * Tq * H
    pos = 8 * Tq * (cp - 1 if comm == "ring" else cp)
    merged = B * Tq * H * hd * item if H > 1 and Tq > 1 else 0
    return (heads - lse) * item + lse * max(item, 4) + merged + pos


def context_positions_bytes(Tq: int) -> int:
    """The rank's own global positions (host int64), which every layer's cache of a pass references."""
    return 8 * Tq
