"""The blocked flash attention (hpengine/nn/flash.py) against plain attention (nn/attention.py, nn/gqa.py)
and against finite differences, in float64: GPT's fused head-major qkv and Llama's grouped-query layout,
block sizes that do and do not divide T (down to 1), groups of 1, 2 and 4 query heads and multi-query."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hpengine.layout.cache import cache_nbytes
from hpengine.nn import attention_backward, attention_forward
from hpengine.nn import flash
from hpengine.nn.gqa import gqa_attention_backward, gqa_attention_forward
from test_layers import numgrad

TOL = dict(rtol=1e-12, atol=1e-12)


def rng(seed):
    return np.random.default_rng(seed)


def rel_err(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(a) + np.linalg.norm(b), 1e-30)


def gqa_inputs(r, B, H, K, T, hd):
    q = r.standard_normal((B, H, T, hd)) / math.sqrt(hd)
    k = r.standard_normal((B, K, T, hd))
    vbase = r.standard_normal((B, T, K * hd))
    return q, k, vbase, vbase.reshape(B, T, K, hd).transpose(0, 2, 1, 3)   # v: the projection's output per head


# (T, bq, bk): blocks that divide T, that do not, block 1, one block larger than T, unequal blocks
BLOCKS = [(8, 4, 4), (7, 3, 2), (5, 1, 1), (6, 64, 64), (9, 2, 4)]


@pytest.mark.parametrize("T,bq,bk", BLOCKS)
def test_gpt_layout_equals_plain_attention(T, bq, bk):
    B, H, hd = 2, 3, 4
    r = rng(1)
    qkv = r.standard_normal((B, T, 3 * H * hd)) * 2.0       # scores well away from uniform
    dy = r.standard_normal((B, T, H * hd))
    y, c = attention_forward(np, qkv, H)
    yf, cf = flash.flash_attention_forward(np, qkv, H, bq, bk)
    np.testing.assert_allclose(yf, y, **TOL)
    np.testing.assert_allclose(flash.flash_attention_backward(np, dy, cf), attention_backward(np, dy, c), **TOL)
    # the saved lse is the log-sum-exp of each row's causal scores
    q5 = qkv.reshape(B, T, H, 3, hd)
    s = np.einsum("bthd,bshd->bhts", q5[:, :, :, 0], q5[:, :, :, 1]) / math.sqrt(hd)
    s[..., np.triu(np.ones((T, T), bool), 1)] = -np.inf
    np.testing.assert_allclose(cf[2], np.log(np.exp(s).sum(-1)), **TOL)


# (B, H, K, T, hd, bq, bk): groups g = H / K of 1, 2, 4; K = 1 multi-query; T not a multiple of the blocks
GQA = [(2, 2, 2, 7, 4, 3, 2), (1, 4, 2, 7, 2, 2, 3), (2, 4, 1, 6, 3, 4, 4), (1, 8, 2, 5, 2, 1, 1),
       (1, 3, 1, 9, 4, 64, 64), (2, 4, 4, 1, 2, 2, 2)]


@pytest.mark.parametrize("B,H,K,T,hd,bq,bk", GQA)
def test_gqa_layout_equals_plain_gqa(B, H, K, T, hd, bq, bk):
    r = rng(2)
    q, k, _, v = gqa_inputs(r, B, H, K, T, hd)
    q *= 3.0
    dy = r.standard_normal((B, T, H * hd))
    y, c = gqa_attention_forward(np, q, k, v)
    yf, cf = flash.flash_gqa_forward(np, q, k, v, bq, bk)
    np.testing.assert_allclose(yf, y, **TOL)
    for got, want in zip(flash.flash_gqa_backward(np, dy, cf), gqa_attention_backward(np, dy, c)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("T,bq,bk", [(7, 3, 2), (5, 1, 1)])
def test_gpt_layout_fd(T, bq, bk):
    B, H, hd = 1, 2, 3
    r = rng(3)
    qkv = r.standard_normal((B, T, 3 * H * hd))
    ry = r.standard_normal((B, T, H * hd))
    _, cache = flash.flash_attention_forward(np, qkv, H, bq, bk)
    dqkv = flash.flash_attention_backward(np, ry, cache)
    f = lambda: np.sum(flash.flash_attention_forward(np, qkv, H, bq, bk)[0] * ry)   # noqa: E731
    num = numgrad(f, qkv)
    assert rel_err(num, dqkv) < 1e-8 and np.linalg.norm(num) > 1e-3


@pytest.mark.parametrize("B,H,K,T,hd,bq,bk", [(1, 4, 2, 6, 2, 4, 3), (1, 4, 1, 5, 2, 1, 2), (1, 2, 2, 5, 2, 2, 2)])
def test_gqa_layout_fd(B, H, K, T, hd, bq, bk):
    r = rng(4)
    q, k, vbase, v = gqa_inputs(r, B, H, K, T, hd)
    ry = r.standard_normal((B, T, H * hd))
    _, cache = flash.flash_gqa_forward(np, q, k, v, bq, bk)
    dq, dk, dv = flash.flash_gqa_backward(np, ry, cache)
    f = lambda: np.sum(flash.flash_gqa_forward(np, q, k, v, bq, bk)[0] * ry)          # noqa: E731
    for x, ana, what in [(q, dq, "dq"), (k, dk, "dk"), (vbase, dv.transpose(0, 2, 1, 3).reshape(B, T, K * hd), "dv")]:
        num = numgrad(f, x)
        assert rel_err(num, ana) < 1e-8 and np.linalg.norm(num) > 1e-3, what


def test_a_wrong_mask_would_fail():
    """The comparison can fail: flash attention without its causal mask is far from plain attention."""
    B, H, T, hd = 1, 2, 6, 2
    qkv = rng(5).standard_normal((B, T, 3 * H * hd))
    y, _ = attention_forward(np, qkv, H)
    saved = flash._bias
    try:
        flash._bias = lambda xp, a, b, c, d, g, dt: xp.zeros((g * (b - a), d - c), dtype=dt)
        yf, _ = flash.flash_attention_forward(np, qkv, H, 2, 2)
    finally:
        flash._bias = saved
    assert np.abs(yf - y).max() > 1e-2


def test_cache_holds_no_scores_and_matches_its_count():
    B, H, K, T, hd = 2, 4, 2, 16, 8
    r = rng(6)
    q, k, vbase, v = gqa_inputs(r, B, H, K, T, hd)
    y, cache = flash.flash_gqa_forward(np, q, k, v, 4, 4)
    assert cache_nbytes(cache, set()) == flash.flash_cache_elements(B, T, H, K, hd) * 8
    assert cache[4].shape == (B, H, T)              # lse, one per query row and head
    qkv = r.standard_normal((B, T, 3 * H * hd))
    y, cache = flash.flash_attention_forward(np, qkv, H, 4, 4)
    assert cache_nbytes(cache, set()) == flash.flash_cache_elements(B, T, H, H, hd) * 8
    _, std = attention_forward(np, qkv, H)
    assert cache_nbytes(std, set()) - cache_nbytes(cache, set()) > B * H * T * T // 2 * 8


def test_float16_computes_in_float32():
    B, H, T, hd = 2, 2, 7, 8
    qkv = rng(7).standard_normal((B, T, 3 * H * hd)).astype(np.float16)
    y, cache = flash.flash_attention_forward(np, qkv, H, 3, 3)
    ref, _ = attention_forward(np, qkv.astype(np.float64), H)
    assert y.dtype == np.float16 and cache[2].dtype == np.float32
    np.testing.assert_allclose(y, ref, rtol=0, atol=5e-3)
    dq = flash.flash_attention_backward(np, np.ones((B, T, H * hd), np.float16), cache)
    assert dq.dtype == np.float16 and np.isfinite(dq).all()
    assert cache_nbytes(cache, set()) == flash.flash_cache_bytes(B, T, H, H, hd, 2)


# ---- packed documents: the tile plan (skipped tiles, one-document tiles, boxes of tiles across a boundary)

PACKED = [[40, 3, 1, 90, 26], [160], [7, 129, 24], [1] * 20 + [140]]     # rows of 160: mixed, whole, short


@pytest.mark.parametrize("rows", [PACKED, PACKED[::2] + PACKED[3:]])     # a row of one document keeps boxes whole
@pytest.mark.parametrize("bq,bk", [(None, None), (16, 16), (32, 8), (7, 5), (64, 64)])
def test_packed_documents_equal_attention_written_out(bq, bk, rows):
    """The blocked core over packed rows (tiles skipped, kept whole inside one document, cut to their box across
    a boundary) against attention written out with the document mask, float64, grouped heads."""
    from test_ring_documents import doc_oracle, segments_of
    B, H, K, T, hd = len(rows), 4, 2, 160, 8
    seg = segments_of(rows)
    r = rng(11)
    q, k, v, do = (r.standard_normal((B, n, T, hd)) for n in (H, K, K, H))
    want = doc_oracle(q, k, v, do, seg, 1.0)
    y, cache = flash.flash_gqa_forward(np, q, k, v, bq, bk, segments=seg)
    dy = np.ascontiguousarray(do.transpose(0, 2, 1, 3)).reshape(B, T, H * hd)
    got = (y.reshape(B, T, H, hd).transpose(0, 2, 1, 3), *flash.flash_gqa_backward(np, dy, cache, segments=seg))
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, b, **TOL, err_msg=name)


def test_tile_plan_boxes_hold_every_visible_pair():
    """Each tile across a boundary is cut to a box that holds every (query, key) pair the mask leaves in it and
    is smaller than the tile somewhere; tiles no document spans are skipped."""
    from test_ring_documents import segments_of
    seg = segments_of(PACKED)[[0, 2, 3]]          # (a row of one document would keep every box whole)
    T = seg.shape[1]
    plan = flash._TilePlan(np, seg, T, 16, 16)
    ar = np.arange(T)
    visible = (seg[:, :, None] == seg[:, None, :]) & (ar[None, None, :] <= ar[None, :, None])   # (B, query, key)
    cut = skipped = 0
    for i, (a, b) in enumerate(plan.q):
        for j, (c, d) in enumerate(plan.k):
            inside = visible[:, a:b, c:d].any(axis=0)
            if c > b - 1:                   # after the diagonal: never visited
                continue
            if plan.skip(i, j):
                skipped += 1
                assert not inside.any()
                continue
            a2, b2, c2, d2 = (a, b, c, d) if plan.one_document(i, j) else plan.box(i, j)
            assert inside[a2 - a:b2 - a, c2 - c:d2 - c].sum() == inside.sum()
            cut += (b2 - a2) * (d2 - c2) < (b - a) * (d - c)
    assert cut and skipped


def test_packed_documents_on_the_cupy_stand_in_equal_numpy(monkeypatch):
    """The same core on CuPy (the stand-in of emulated_cupy.py: cuBLAS on the tiles' strided views, the tile plan
    read from one host copy of the segments) gives NumPy's numbers."""
    import emulated_cupy
    from test_ring_documents import segments_of
    rows = PACKED[::2] + PACKED[3:]
    B, H, K, T, hd = len(rows), 4, 2, 160, 8
    seg = segments_of(rows)
    r = rng(12)
    q, k, v = (r.standard_normal((B, n, T, hd)) for n in (H, K, K))
    dy = r.standard_normal((B, T, H * hd))
    y, cache = flash.flash_gqa_forward(np, q, k, v, 16, 16, segments=seg)
    want = (y, *flash.flash_gqa_backward(np, dy, cache, segments=seg))
    cp = emulated_cupy.install(monkeypatch)
    monkeypatch.setattr(flash, "CUDA", False)     # this core, not the kernels (tests/gpu/test_flash_documents_gpu.py)
    from hpengine.nn import gemm
    calls, matmul = [], gemm.matmul
    monkeypatch.setattr(gemm, "matmul", lambda *a, **kw: calls.append(1) or matmul(*a, **kw))
    yd, cd = flash.flash_gqa_forward(cp, *(cp.asarray(a) for a in (q, k, v)), 16, 16, segments=cp.asarray(seg))
    got = (yd, *flash.flash_gqa_backward(cp, cp.asarray(dy), cd, segments=cp.asarray(seg)))
    for name, a, b in zip(("y", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a.get(), b, **TOL, err_msg=name)
    assert calls                                  # through cuBLAS, not NumPy's matmul
