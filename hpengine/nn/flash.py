"""Fused causal attention, flash-attention style (model.attention = "flash"): an online softmax over key
blocks up to the diagonal, the T x T scores never stored. The array-module-generic code that runs on the
CPU, the NumPy twin of kernels/attention.cu (which hpengine/nn/flash_cuda.py launches on CuPy). Packed
documents (segments): a query sees only its own document's keys; tiles no document spans are skipped (here too).
"""
from __future__ import annotations

import math

import numpy as np

from hpengine.device.bf16_bits import as_float32, to_bf16_bits
from hpengine.nn import flash_cuda
from hpengine.nn.attention import _heads, _mm
from hpengine.nn.gqa import gqa_shapes
from hpengine.nn.numerics import OFF

BQ = 64          # query positions per block on the CPU (read at call time when bq is None)
BK = 64          # keys per block (likewise)
# Packed documents (segments): larger tiles, read likewise. Most tiles are skipped and a tile across a boundary
# is cut to its box of visible queries and keys, so the per-tile overhead weighs more than the masked work a
# larger tile visits (benchmarks/bench_packed.py: faster at mean document lengths 128 and 512, seq 4096).
BQ_DOCS = 128
BK_DOCS = 128
# This array-module-generic code is what runs on the CPU, and it is the NumPy twin of kernels/attention.cu
# (hpengine/nn/flash_cuda.py launches it when xp is CuPy and the dtype is float32 or float64). Under bf16
# amp its products take bfloat16 operands (attention._mm), P and dS included: the twin of the tensor-core
# kernels/attention_mma.cu, which flash_cuda launches then. Half precision inputs are computed in float32
# here; lse is then float32.
CUDA = True      # launch kernels/attention.cu on CuPy (False: run this code on CuPy too)


def flash_cache_elements(B: int, T: int, H: int, K: int, hd: int) -> int:
    """Elements the forward caches for B sequences of T tokens, H query heads over K key/value heads of
    hd: q (H), k and v (K each), the output (H) per token and head dim (GPT's fused qkv and output are
    the same 4H with K = H), and one lse per query head and position. No score is kept: no T^2 term."""
    return B * T * (hd * (2 * H + 2 * K) + H)


def flash_cache_bytes(B: int, T: int, H: int, K: int, hd: int, item: int) -> int:
    """flash_cache_elements in bytes; lse is stored in float32 at least (half inputs compute in float32)."""
    return B * T * (hd * (2 * H + 2 * K) * item + H * max(item, 4))


def _tiles(T: int, b: int):
    return [(a, min(a + b, T)) for a in range(0, T, b)]


def _tile_sizes(bq, bk, segments) -> tuple:
    """(bq, bk): the given ones, else the defaults (packed documents: their own)."""
    if segments is None:
        return bq or BQ, bk or BK
    return bq or BQ_DOCS, bk or BK_DOCS


def _ctype(xp, dtype):
    return np.dtype(np.float32) if np.dtype(dtype).itemsize < 4 else np.dtype(dtype)


def _bias(xp, a, b, c, d, g, dtype):
    # (g*(b-a), d-c): -inf where key c+j comes after query a + i // g, else 0
    qpos = a + xp.arange(g * (b - a)) // g
    kpos = c + xp.arange(d - c)
    return xp.where(kpos[None, :] > qpos[:, None], -xp.inf, 0.0).astype(dtype)


class _TilePlan:
    """One call's query tiles `q` and key tiles `k` and, for packed documents (segments (B, T), rising along
    each row), for every (query tile i, key tile j): whether some row's queries and keys hold a document in
    common (else every score is masked: `skip`), whether they lie in one document in every row (no document
    mask: `one_document`), and else the `box` of the tile's queries and keys that see anything. Read from the
    segments on the host (one copy from a device, not one per tile). The kernels skip by the same rule per row (a
    tile kept here for some row only is wholly masked in the others, where it adds exact zeros)."""

    def __init__(self, xp, segments, T: int, bq: int, bk: int):
        self.q, self.k = _tiles(T, bq), _tiles(T, bk)
        self.visit = self.one = None
        if segments is None:
            return
        seg = segments.get() if xp.__name__ == "cupy" else np.asarray(segments)
        qa, qb = (seg[:, list(ends)][:, :, None] for ends in zip(*[(a, b - 1) for a, b in self.q]))
        ka, kb = (seg[:, list(ends)][:, None, :] for ends in zip(*[(c, d - 1) for c, d in self.k]))
        self.visit = ((ka <= qb) & (qa <= kb)).any(axis=0).tolist()        # the ranges of ids meet
        self.one = ((qa == qb) & (ka == kb) & (qa == ka)).all(axis=0).tolist()
        # each position's document as [start, end) of positions
        idx = np.arange(T)
        first = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
        last = np.concatenate([first[:, 1:], np.ones((seg.shape[0], 1), bool)], axis=1)
        self.start = np.maximum.accumulate(np.where(first, idx, 0), axis=1)
        self.end = np.minimum.accumulate(np.where(last, idx + 1, T)[:, ::-1], axis=1)[:, ::-1]

    def skip(self, i: int, j: int) -> bool:
        return self.visit is not None and not self.visit[i][j]

    def one_document(self, i: int, j: int) -> bool:
        return self.one is None or self.one[i][j]

    def box(self, i: int, j: int) -> tuple:
        """(a, b, c, d): the tile cut to its queries a..b-1 that see a key of it and its keys c..d-1 that a query
        of it sees, in some row (the rest would add exact zeros)."""
        (a, b), (c, d) = self.q[i], self.k[j]
        rows = (np.maximum(c, self.start[:, a:b]) <= np.minimum(d - 1, np.arange(a, b))).any(axis=0)
        keys = (np.maximum(a, np.arange(c, d)) <= np.minimum(b - 1, self.end[:, c:d] - 1)).any(axis=0)
        r, k = np.flatnonzero(rows), np.flatnonzero(keys)
        return a + int(r[0]), a + int(r[-1]) + 1, c + int(k[0]), c + int(k[-1]) + 1


def _tile_mask(xp, segments, one: bool, a, b, c, d, g, ct, causal: dict):
    """(the additive mask of the tile of queries a..b-1 and keys c..d-1, or None when every score counts;
    whether every query of the tile sees a key in it). one: the tile lies in one document (_TilePlan). Across
    documents: -inf where the key is in another document or after the query, one (B, 1, g*(b-a), d-c) array
    added to every head's scores; within one, the causal mask alone, which aligned tiles repeat: `causal`
    keeps this call's."""
    if one:
        sees = c <= a or segments is None      # one document: key c, before every query, is seen by all
        if d - 1 <= a:                          # wholly below the diagonal
            return None, sees
        key = (b - a, c - a, d - c)
        if key not in causal:
            causal[key] = _bias(xp, a, b, c, d, g, ct)
        return causal[key], sees
    q = a + xp.arange(g * (b - a)) // g
    ok = (segments[:, q][:, None, :, None] == segments[:, None, None, c:d]) & (xp.arange(c, d)[None, :] <= q[:, None])
    return xp.where(ok, 0.0, -xp.inf).astype(ct), False


def _use_cuda(xp, *arrays) -> bool:
    # one storage type: float32, float64, or bfloat16 bits (uint16, the tensor-core entries' bf16 storage)
    return (CUDA and xp.__name__ == "cupy" and all(a.dtype == arrays[0].dtype for a in arrays)
            and (arrays[0].dtype.kind == "f" and arrays[0].dtype.itemsize in (4, 8) or arrays[0].dtype == np.uint16))


# Query positions come in blocks of `bq`, keys in blocks of `bk`. A query block walks the key blocks up to
# the diagonal with an online softmax (a running row max m and row sum l); key blocks wholly above the
# diagonal are never visited. The T x T scores are never stored: forward keeps only its output and the
# row log-sum-exp lse = m + log(l), (B, H, T). Backward recomputes each score tile from lse,
# p = exp(s - lse), and uses D = rowsum(dO * O) in place of rowsum(dP * P), as FlashAttention-2 does.
#
# Both layouts of the models go through one blocked core over grouped rows: the g = H / K query heads of
# a key/value head fold into the row axis, row t * g + j being query head k * g + j at position t, so a
# tile is one batched GEMM per (batch row, key/value head) and dK, dV sum over the group inside it.
def flash_forward_core(xp, qg, k, v, g: int, bq: int | None = None, bk: int | None = None, num=OFF,
                       segments=None):
    """qg (B, K, T*g, hd) grouped rows (already scaled), k (B, K, T, hd), v (B, K, T, dv) in any strides (dv may
    differ from hd: multi-head latent attention) -> og (B, K, T*g, dv) and lse (B, K, T*g), in the compute dtype.
    segments: (B, T) document ids (None: one document a row)."""
    B, K, R, hd = qg.shape
    T, dv = k.shape[2], v.shape[-1]
    bq, bk = _tile_sizes(bq, bk, segments)
    ct = _ctype(xp, qg.dtype)
    qg, k, v = (a.astype(ct, copy=False) for a in (qg, k, v))
    og = xp.empty((B, K, R, dv), dtype=ct)
    lse = xp.empty((B, K, R), dtype=ct)
    causal, plan = {}, _TilePlan(xp, segments, T, bq, bk)
    for i, (a, b) in enumerate(plan.q):
        rows = slice(a * g, b * g)
        qb = qg[:, :, rows]
        n = (b - a) * g
        m = xp.full((B, K, n, 1), -xp.inf, dtype=ct)
        s_l = xp.zeros((B, K, n, 1), dtype=ct)
        acc = xp.zeros((B, K, n, dv), dtype=ct)
        for j, (c, d) in enumerate(plan.k):
            if c > b - 1:               # every key after every query of the block: skipped
                break
            if plan.skip(i, j):
                continue                # no document in common: every score masked, nothing to add
            # packed documents: a tile across a boundary shrinks to the queries and keys that see anything
            one = plan.one_document(i, j)
            a2, b2, c2, d2 = (a, b, c, d) if one else plan.box(i, j)
            lo, hi = (a2 - a) * g, (b2 - a) * g
            s = _mm(xp, qb[:, :, lo:hi], k[:, :, c2:d2].swapaxes(-1, -2), num=num)
            mask, sees = _tile_mask(xp, segments, one, a2, b2, c2, d2, g, ct, causal)
            mv, lv, av = m[:, :, lo:hi], s_l[:, :, lo:hi], acc[:, :, lo:hi]
            if mask is not None:        # the diagonal, or (packed documents) a tile across a boundary
                s += mask
            if sees:
                # the first key block holds key 0, which every query sees: m is finite from then on (packed
                # documents: a tile inside one document whose first key every query sees; the shifted path
                # below would compute the same numbers)
                mn = xp.maximum(mv, s.max(axis=-1, keepdims=True))
                alpha = xp.exp(mv - mn)
                s -= mn
            else:
                # a row may have seen no key of its document yet (m and the tile's max -inf): shift by 0 there,
                # so exp gives exact zeros and no NaN
                mn = xp.maximum(mv, s.max(axis=-1, keepdims=True))
                shift = xp.where(xp.isneginf(mn), 0.0, mn)
                alpha = xp.exp(mv - shift)
                s -= shift
            xp.exp(s, out=s)
            lv *= alpha
            lv += s.sum(axis=-1, keepdims=True)
            av *= alpha
            _mm(xp, s, v[:, :, c2:d2], av, accumulate=True, num=num)
            mv[...] = mn
        og[:, :, rows] = acc / s_l
        lse[:, :, rows] = (m + xp.log(s_l))[..., 0]
    return og, lse


def flash_backward_core(xp, qg, k, v, og, dog, lse, g: int, bq: int | None = None, bk: int | None = None,
                        num=OFF, segments=None):
    """Gradients of the blocked attention from its saved output og and lse (grouped rows, as in
    flash_forward_core; og and dog dv wide, as v): -> dqg (B, K, T*g, hd), dk (B, K, T, hd), dv (B, K, T, dv), in
    the compute dtype."""
    B, K, R, hd = qg.shape
    T, wv = k.shape[2], v.shape[-1]
    bq, bk = _tile_sizes(bq, bk, segments)
    ct = _ctype(xp, qg.dtype)
    qg, k, v, og, dog, lse = (a.astype(ct, copy=False) for a in (qg, k, v, og, dog, lse))
    dd = xp.einsum("bkrd,bkrd->bkr", dog, og)[..., None]       # D = rowsum(dO * O)
    lse = lse[..., None]
    dqg = xp.zeros((B, K, R, hd), dtype=ct)
    dk, dv = xp.empty((B, K, T, hd), dtype=ct), xp.empty((B, K, T, wv), dtype=ct)
    causal, plan = {}, _TilePlan(xp, segments, T, bq, bk)
    for j, (c, d) in enumerate(plan.k):
        kb, vb = k[:, :, c:d], v[:, :, c:d]
        dkb, dvb = xp.zeros((B, K, d - c, hd), dtype=ct), xp.zeros((B, K, d - c, wv), dtype=ct)
        for i, (a, b) in enumerate(plan.q):
            if b - 1 < c or plan.skip(i, j):     # every query before every key, or no document in common
                continue
            one = plan.one_document(i, j)       # else the tile's box (as in forward)
            a2, b2, c2, d2 = (a, b, c, d) if one else plan.box(i, j)
            rows, keys = slice(a2 * g, b2 * g), slice(c2 - c, d2 - c)
            qb, dob, kbs, vbs = qg[:, :, rows], dog[:, :, rows], kb[:, :, keys], vb[:, :, keys]
            s = _mm(xp, qb, kbs.swapaxes(-1, -2), num=num)
            mask = _tile_mask(xp, segments, one, a2, b2, c2, d2, g, ct, causal)[0]
            if mask is not None:
                s += mask
            s -= lse[:, :, rows]
            p = xp.exp(s, out=s)
            _mm(xp, p.swapaxes(-1, -2), dob, dvb[:, :, keys], accumulate=True, num=num)
            ds = _mm(xp, dob, vbs.swapaxes(-1, -2), num=num)
            ds -= dd[:, :, rows]
            ds *= p
            _mm(xp, ds.swapaxes(-1, -2), qb, dkb[:, :, keys], accumulate=True, num=num)
            dqg[:, :, rows] += _mm(xp, ds, kbs, num=num)
        dk[:, :, c:d] = dkb
        dv[:, :, c:d] = dvb
    return dqg, dk, dv


# ---- GPT: fused head-major qkv (B, T, H*3*hd) -> (B, T, H*hd) ------------------------------------------

def flash_attention_forward(xp, qkv, n_heads: int, bq: int | None = None, bk: int | None = None, num=OFF,
                            segments=None):
    """Twin of attention_forward: returns y (B, T, H*hd) and the cache (qkv, y, lse, bq, bk). Under bf16 amp qkv
    may be bfloat16 bits (packed: the kernels' bf16 storage, y then bits too) and y, which only the projection
    and this cache read, is stored as bf16 amp stores it (num.store_for_gemm). segments: (B, T) document ids of
    packed documents (None: one a row), handed to the kernels on CuPy."""
    B, T, C3 = qkv.shape
    if C3 % (3 * n_heads):
        raise ValueError(f"qkv last dim {C3} is not a multiple of 3 * n_heads = {3 * n_heads}")
    hd = C3 // (3 * n_heads)
    scale = 1.0 / math.sqrt(hd)
    q, k, v = _heads(qkv, n_heads, 3)
    cuda = _use_cuda(xp, qkv)
    bits_twin = qkv.dtype == np.uint16 and not cuda       # the twin computes on the bits' values
    y = xp.empty((B, T, n_heads * hd), dtype=np.float32 if bits_twin else qkv.dtype)
    (o,) = _heads(y, n_heads, 1)
    if cuda:
        lse = flash_cuda.forward(xp, q, k, v, o, scale, mma=flash_cuda.use_mma(q.dtype, num.bf16), segments=segments)
    else:
        q, k, v = (as_float32(xp, t) for t in (q, k, v))
        og, lse = flash_forward_core(xp, q * scale, k, v, 1, bq, bk, num, segments)
        o[...] = og
    y = num.store_for_gemm(xp, y)
    return y, (qkv, y, lse, bq, bk)


def flash_attention_backward(xp, dy, cache, num=OFF, segments=None):
    """Twin of attention_backward: dy (B, T, H*hd) -> dqkv (B, T, H*3*hd). Under bf16 amp dO and dqkv are stored
    as bf16 amp stores them (bits when packed: the kernels' bf16 storage; only the qkv projection reads dqkv)."""
    qkv, y, lse, bq, bk = cache
    B, T, C3 = qkv.shape
    H = lse.shape[1]
    scale = 1.0 / math.sqrt(C3 // (3 * H))
    bf16 = num.stores and dy.dtype == np.float32
    if bf16:
        dy = num.store_for_gemm(xp, dy)                     # (rounded in place: dy is this backward's own)
    q, k, v = _heads(qkv, H, 3)
    (do,), (o,) = _heads(dy, H, 1), _heads(y, H, 1)
    if _use_cuda(xp, qkv, dy, y):
        dqkv = xp.empty((B, T, C3), dtype=dy.dtype)
        flash_cuda.backward(xp, q, k, v, o, do, lse, *_heads(dqkv, H, 3), scale,
                            mma=flash_cuda.use_mma(q.dtype, num.bf16), segments=segments)
        return num.store_for_gemm(xp, dqkv, bf16)            # (bits already: as they are)
    q, k, v, o, do = (as_float32(xp, t) for t in (q, k, v, o, do))
    dqkv = xp.empty((B, T, C3), dtype=do.dtype)
    dq, dk, dv = _heads(dqkv, H, 3)
    dqg, dkg, dvg = flash_backward_core(xp, q * scale, k, v, o, do, lse, 1, bq, bk, num, segments)
    dqg *= scale
    dq[...], dk[...], dv[...] = dqg, dkg, dvg
    return num.store_for_gemm(xp, dqkv, bf16)


# ---- Llama: grouped-query q (B, H, T, hd) rotated and scaled, k (B, K, T, hd), v (B, K, T, dv) --------------
# (dv is hd but for multi-head latent attention, nn/mla.py, whose values are narrower than its queries and keys)

def _group_rows(a, K, g):
    # (B, K*g, T, hd) -> (B, K, T*g, hd), row t*g + j = head k*g + j at t (a view when g == 1)
    B, _, T, hd = a.shape
    return a.reshape(B, K, g, T, hd).swapaxes(2, 3).reshape(B, K, T * g, hd)


def _token_rows(a, K, g):
    # (B, T, K*g*hd) -> (B, K, T*g, hd) in grouped-row order (a copy unless K == 1)
    B, T, _ = a.shape
    return a.reshape(B, T, K, g, -1).transpose(0, 2, 1, 3, 4).reshape(B, K, T * g, -1)


def flash_gqa_forward(xp, q, k, v, bq: int | None = None, bk: int | None = None, num=OFF, segments=None):
    """Twin of gqa_attention_forward: returns y (B, T, H*dv) and the cache (q, k, v, y, lse, bq, bk). Under bf16
    amp q, k, v may be bfloat16 bits (packed: the kernels' bf16 storage, y then bits too) and y, which only the o
    projection and this cache read, is stored as bf16 amp stores it (num.store_for_gemm)."""
    if num.writes_bits and xp.__name__ == "cupy":       # one storage type for the kernels: bits
        q, k, v = (t if t.dtype == np.uint16 else to_bf16_bits(xp, t) for t in (q, k, v))
    (B, H, T, hd, K, g), y = gqa_shapes(xp, q, k, v)
    dv = v.shape[-1]
    if _use_cuda(xp, q, k, v):
        lse = flash_cuda.forward(xp, q, k, v, y.reshape(B, T, H, dv).transpose(0, 2, 1, 3), 1.0,
                                 mma=flash_cuda.use_mma(q.dtype, num.bf16), segments=segments)
    else:
        if y.dtype == np.uint16:
            y = xp.empty(y.shape, dtype=np.float32)
        og, lseg = flash_forward_core(xp, _group_rows(as_float32(xp, q), K, g), as_float32(xp, k), as_float32(xp, v),
                                      g, bq, bk, num, segments)
        y.reshape(B, T, K, g, dv).transpose(0, 2, 1, 3, 4)[...] = og.reshape(B, K, T, g, dv)
        lse = xp.ascontiguousarray(lseg.reshape(B, K, T, g).swapaxes(2, 3).reshape(B, H, T))
    y = num.store_for_gemm(xp, y)
    return y, (q, k, v, y, lse, bq, bk)


def flash_gqa_backward(xp, dy, cache, num=OFF, segments=None):
    """Twin of gqa_attention_backward: dy (B, T, H*dv) -> dq (B, H, T, hd), dk (B, K, T, hd), dv (B, K, T, dv)."""
    q, k, v, y, lse, bq, bk = cache
    B, H, T, hd = q.shape
    wv = v.shape[-1]
    K = k.shape[1]
    g = H // K
    bf16 = num.stores and dy.dtype == np.float32            # dO and the gradients stored as bf16 amp stores them
    if bf16:
        dy = num.store_for_gemm(xp, dy)                     # (rounded in place: dy is this backward's own)
    if _use_cuda(xp, q, k, v, dy):
        dq, dk, dv = (xp.empty(a.shape, dtype=dy.dtype) for a in (q, k, v))
        per_head = lambda a: a.reshape(B, T, H, wv).transpose(0, 2, 1, 3)     # noqa: E731
        flash_cuda.backward(xp, q, k, v, per_head(y), per_head(dy), lse, dq, dk, dv, 1.0,
                            mma=flash_cuda.use_mma(q.dtype, num.bf16), segments=segments)
        return tuple(num.store_for_gemm(xp, t, bf16) for t in (dq, dk, dv))   # (bits already: as they are)
    q, k, v, y, dy = (as_float32(xp, t) for t in (q, k, v, y, dy))
    lseg = lse.reshape(B, K, g, T).swapaxes(2, 3).reshape(B, K, T * g)
    dqg, dk, dv = flash_backward_core(xp, _group_rows(q, K, g), k, v, _token_rows(y, K, g),
                                      _token_rows(dy, K, g), lseg, g, bq, bk, num, segments)
    dq = xp.ascontiguousarray(dqg.reshape(B, K, T, g, hd).transpose(0, 1, 3, 2, 4).reshape(B, H, T, hd))
    dt = dy.dtype
    return tuple(num.store_for_gemm(xp, t.astype(dt, copy=False), bf16) for t in (dq, dk, dv))
