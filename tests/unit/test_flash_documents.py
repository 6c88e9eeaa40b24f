"""Packed documents in flash attention's NumPy twin (nn/flash.py, the twin of the kernels' segment ids): outputs
and gradients equal plain softmax attention under the block-causal document mask (float64), and a tile pair
that no document spans is skipped, not computed and masked (NaN keys there do not reach other documents). The
kernels' loop bounds (attention*.cu doc_start / doc_end) keep the very tile pairs the rule keeps."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hpengine.nn import flash

TOL = 1e-12     # float64: only the order of the sums differs (online softmax, blocked GEMMs), T <= 200 terms


def ids(lengths_per_row):
    """(B, T) document ids from each row's document lengths (ids restart at 0 in each row)."""
    return np.array([np.repeat(np.arange(len(ls)), ls) for ls in lengths_per_row])


def masked_attention(q, k, v, seg):
    """Plain float64 attention of (B, H, T, hd) q over (B, K, T, hd) k, v (head h reads k/v head h // (H / K)):
    softmax over the keys that are causal and of the query's document, the T x T scores stored."""
    B, H, T, hd = q.shape
    g = H // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = q @ kk.swapaxes(-1, -2)
    seen = np.tril(np.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    s = np.where(seen[:, None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p @ vv, p, kk, vv, g


def masked_grads(q, k, v, seg, dy):
    """The gradients of masked_attention by hand: dP = dY V^T, dS = P (dP - rowsum(dP P)), summed over a group."""
    y, p, kk, vv, g = masked_attention(q, k, v, seg)
    dp = dy @ vv.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    B, K, T, hd = k.shape
    dk = (ds.swapaxes(-1, -2) @ q).reshape(B, K, g, T, hd).sum(axis=2)
    dv = (p.swapaxes(-1, -2) @ dy).reshape(B, K, g, T, hd).sum(axis=2)
    return ds @ kk, dk, dv


def close(got, want, tol=TOL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and np.isfinite(got).all()
    assert np.abs(got - want).max() <= tol * max(1.0, float(np.abs(want).max()))


ROWS = [[70, 5, 90, 35], [1, 64, 64, 71]]           # T 200: boundaries on and off the tiles, a document of one


@pytest.mark.parametrize("bq,bk", [(None, None), (16, 64), (7, 5), (64, 16)])
@pytest.mark.parametrize("H,K", [(2, 2), (4, 2), (4, 1)])
def test_gqa_twin_equals_masked_attention(H, K, bq, bk):
    B, T, hd = 2, 200, 16
    rng = np.random.default_rng(4)
    seg = ids(ROWS)
    q = rng.standard_normal((B, H, T, hd)) / math.sqrt(hd) * 2
    k, v = rng.standard_normal((B, K, T, hd)), rng.standard_normal((B, K, T, hd))
    dy = rng.standard_normal((B, T, H * hd))
    y, c = flash.flash_gqa_forward(np, q, k, v, bq, bk, segments=seg)
    want, *_ = masked_attention(q, k, v, seg)
    close(y, want.transpose(0, 2, 1, 3).reshape(B, T, H * hd))
    grads = flash.flash_gqa_backward(np, dy, c, segments=seg)
    for got, w in zip(grads, masked_grads(q, k, v, seg, dy.reshape(B, T, H, hd).transpose(0, 2, 1, 3))):
        close(got, w)


def test_gpt_twin_equals_masked_attention():
    B, T, H, hd = 2, 200, 3, 8
    rng = np.random.default_rng(5)
    seg = ids(ROWS)
    qkv = rng.standard_normal((B, T, 3 * H * hd))
    dy = rng.standard_normal((B, T, H * hd))
    y, c = flash.flash_attention_forward(np, qkv, H, 32, 32, segments=seg)
    q, k, v = (qkv.reshape(B, T, H, 3, hd)[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
    want, *_ = masked_attention(q / math.sqrt(hd), k, v, seg)
    close(y, want.transpose(0, 2, 1, 3).reshape(B, T, H * hd))
    dq, dk, dv = masked_grads(q / math.sqrt(hd), k, v, seg, dy.reshape(B, T, H, hd).transpose(0, 2, 1, 3))
    got = flash.flash_attention_backward(np, dy, c, segments=seg).reshape(B, T, H, 3, hd)
    for i, w in enumerate((dq / math.sqrt(hd), dk, dv)):
        close(got[:, :, :, i].transpose(0, 2, 1, 3), w)


def test_a_missing_document_mask_would_fail():
    B, T, H, hd = 1, 40, 1, 4
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((B, H, T, hd)) for _ in range(3))
    y, _ = flash.flash_gqa_forward(np, q, k, v, 8, 8)                     # one document
    want, *_ = masked_attention(q, k, v, ids([[20, 20]]))
    assert np.abs(y - want.transpose(0, 2, 1, 3).reshape(B, T, H * hd)).max() > 1e-3


def test_tiles_no_document_spans_are_skipped_not_masked():
    """NaN keys and values in document A: a masked but visited tile would carry them into document B through
    0 * NaN; skipped, B's outputs and query gradients equal B run alone. Likewise NaN queries and output
    gradients in B leave A's key and value gradients alone."""
    T, A, H, hd, blk = 256, 128, 2, 8, 64            # the boundary on a tile edge: no tile holds both documents
    rng = np.random.default_rng(7)
    seg = ids([[A, T - A]])
    q, k, v = (rng.standard_normal((1, H, T, hd)) for _ in range(3))
    dy = rng.standard_normal((1, T, H * hd))
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[:, :, :A], v_nan[:, :, :A] = np.nan, np.nan
    y, c = flash.flash_gqa_forward(np, q, k_nan, v_nan, blk, blk, segments=seg)
    dq, _, _ = flash.flash_gqa_backward(np, dy, c, segments=seg)
    yb, cb = flash.flash_gqa_forward(np, q[:, :, A:], k[:, :, A:], v[:, :, A:], blk, blk)
    close(y[:, A:], yb)
    close(dq[:, :, A:], flash.flash_gqa_backward(np, dy[:, A:], cb)[0])
    assert np.isnan(y[:, :A]).all()                 # (the NaN does reach its own document)
    q_nan, dy_nan = q.copy(), dy.copy()
    q_nan[:, :, A:], dy_nan[:, A:] = np.nan, np.nan
    _, c = flash.flash_gqa_forward(np, q_nan, k, v, blk, blk, segments=seg)
    _, dk, dv = flash.flash_gqa_backward(np, dy_nan, c, segments=seg)
    ya, ca = flash.flash_gqa_forward(np, q[:, :, :A], k[:, :, :A], v[:, :, :A], blk, blk)
    _, dka, dva = flash.flash_gqa_backward(np, dy[:, :A], ca)
    close(dk[:, :, :A], dka)
    close(dv[:, :, :A], dva)


def _shared_tile(seg, a, b, c, d) -> bool:
    """The tile rule: some row's queries a..b-1 and keys c..d-1 hold a document in common (the ranges of rising
    ids meet)."""
    return bool(((seg[:, c] <= seg[:, b - 1]) & (seg[:, a] <= seg[:, d - 1])).any())


def _doc_start(row, i):
    return int(np.searchsorted(row, row[i], side="left"))


def _doc_end(row, j):
    return int(np.searchsorted(row, row[j], side="right"))


@pytest.mark.parametrize("bq,bk", [(32, 32), (16, 16), (64, 64), (64, 32), (16, 64)])
def test_kernel_walks_keep_the_tiles_the_rule_keeps(bq, bk):
    """The kernels walk key tiles from the one holding doc_start(first query) to the diagonal (fwd, dq) and
    query tiles from the diagonal to doc_end(last key) (dkdv): per row, the tile pairs the rule keeps, as the
    twin's tile plan does."""
    rng = np.random.default_rng(8)
    for _ in range(30):
        T = int(rng.integers(1, 300))
        row = np.sort(rng.integers(0, int(rng.integers(1, 12)), T))
        seg = row[None]
        plan = flash._TilePlan(np, seg, T, bq, bk)                   # the twin skips by the same rule
        for i, a in enumerate(range(0, T, bq)):
            b = min(a + bq, T)
            walked = set(range(_doc_start(row, a) // bk * bk, b, bk))
            kept = {c for c in range(0, b, bk) if _shared_tile(seg, a, b, c, min(c + bk, T))}
            assert walked == kept == {c for j, c in enumerate(range(0, b, bk)) if not plan.skip(i, j)}, (T, a)
        for c in range(0, T, bk):                    # a key block of bk keys, query tiles of bq from its diagonal
            d = min(c + bk, T)
            walked = set(range(c - c % bq, _doc_end(row, d - 1), bq))
            kept = {a for a in range(c - c % bq, T, bq) if _shared_tile(seg, a, min(a + bq, T), c, d)}
            assert walked == kept, (T, c)
