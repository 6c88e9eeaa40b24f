"""The strided-batched GEMM plan of hpengine/nn/gemm.py, checked without a GPU: the planned cuBLAS calls are
emulated in NumPy with cuBLAS's column-major semantics (element (i, j) of a stored matrix at
offset + i + j * ld) on the flat buffers behind the views, and must give np.matmul's result for the views
attention multiplies (per-head q, k, v of a head-major qkv, transposed probabilities, outputs written into
strided head views, accumulation) and for plain and transposed batches."""
import numpy as np
import pytest

from hpengine.nn import gemm


def _matrix(flat, off, rows, cols, ld):
    i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return off + i + j * ld


def emulate(calls, a_flat, b_flat, c_flat, accumulate):
    """Run the calls on flat buffers: cuBLAS's A is b's buffer, its B is a's (see gemm.plan)."""
    for c in calls:
        for t in range(c.batch):
            ia = _matrix(None, c.a_off + t * c.stride_a, *((c.m, c.k) if c.transa == gemm.N else (c.k, c.m)), c.lda)
            ib = _matrix(None, c.b_off + t * c.stride_b, *((c.k, c.n) if c.transb == gemm.N else (c.n, c.k)), c.ldb)
            ic = _matrix(None, c.c_off + t * c.stride_c, c.m, c.n, c.ldc)
            A = b_flat[ia] if c.transa == gemm.N else b_flat[ia].T
            B = a_flat[ib] if c.transb == gemm.N else a_flat[ib].T
            c_flat[ic] = A @ B + (c_flat[ic] if accumulate else 0.0)


def where(view, base):
    """(element offset in base, element strides) of a NumPy view of base."""
    off = (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // base.itemsize
    return off, tuple(s // base.itemsize for s in view.strides)


def check(a, abase, b, bbase, out, obase, accumulate=False, max_calls=None):
    (oa, sa), (ob, sb), (oc, sc) = where(a, abase), where(b, bbase), where(out, obase)
    calls = gemm.plan(a.shape, sa, b.shape, sb, out.shape, sc)
    assert calls is not None
    if max_calls is not None:
        assert len(calls) <= max_calls
    want = obase.copy()
    wview = np.lib.stride_tricks.as_strided(want.reshape(-1)[oc:], out.shape, out.strides)
    wview[...] = (wview if accumulate else 0.0) + np.matmul(a, b)
    fa, fb, fc = abase.reshape(-1), bbase.reshape(-1), obase.reshape(-1).copy()
    # offsets into the flat buffers: the calls carry offsets relative to each view's first element
    emulate([c._replace(a_off=c.a_off + ob, b_off=c.b_off + oa, c_off=c.c_off + oc) for c in calls], fa, fb, fc,
            accumulate)
    np.testing.assert_allclose(fc.reshape(obase.shape), want, rtol=1e-12, atol=1e-12)
    return calls


def heads(a, H, parts):
    B, T, _ = a.shape
    v = a.reshape(B, T, H, parts, -1)
    return [v[:, :, :, i].transpose(0, 2, 1, 3) for i in range(parts)]


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_attention_views(rng):
    B, T, H, hd = 2, 6, 3, 4
    qkv = rng.standard_normal((B, T, 3 * H * hd))
    q, k, v = heads(qkv, H, 3)
    y = rng.standard_normal((B, T, H * hd))
    (o,) = heads(y, H, 1)
    qs = np.ascontiguousarray(q)            # the scaled q is a fresh array
    for a_, b_ in [(0, 3), (3, 6)]:
        p = np.zeros((B, H, b_ - a_, b_))
        check(qs[:, :, a_:b_], qs, k[:, :, :b_].swapaxes(-1, -2), qkv, p, p, max_calls=1 * B)
        p[...] = rng.standard_normal(p.shape)
        check(p, p, v[:, :, :b_], qkv, o[:, :, a_:b_], y)
        dqkv = rng.standard_normal(qkv.shape)
        dq, dk, dv = heads(dqkv, H, 3)
        dy = rng.standard_normal(y.shape)
        (do,) = heads(dy, H, 1)
        check(p.swapaxes(-1, -2), p, do[:, :, a_:b_], dy, dv[:, :, :b_], dqkv, accumulate=True)
        check(p.swapaxes(-1, -2), p, qs[:, :, a_:b_], qs, dk[:, :, :b_], dqkv)
        check(p, p, k[:, :, :b_], qkv, dq[:, :, a_:b_], dqkv)


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_contiguous_batches_are_one_call(rng, ta, tb):
    a = rng.standard_normal((2, 3, 4, 5))
    b = rng.standard_normal((2, 3, 5, 6))
    a_ = np.ascontiguousarray(a.swapaxes(-1, -2)).swapaxes(-1, -2) if ta else a
    b_ = np.ascontiguousarray(b.swapaxes(-1, -2)).swapaxes(-1, -2) if tb else b
    out = np.zeros((2, 3, 4, 6))
    base_a = a_ if not ta else a_.swapaxes(-1, -2)
    base_b = b_ if not tb else b_.swapaxes(-1, -2)
    calls = check(a_, base_a, b_, base_b, out, out)
    assert len(calls) == 1 and calls[0].batch == 6


def test_size_one_dims_and_single_rows(rng):
    a = rng.standard_normal((1, 4, 1, 5))
    b = rng.standard_normal((1, 4, 5, 1))
    out = np.zeros((1, 4, 1, 1))
    check(a, a, b, b, out, out)


def test_unplannable_views_are_refused():
    # neither of the last two axes has unit stride: cupy.matmul (with its copy) takes these
    assert gemm.plan((2, 3, 4), (24, 8, 2), (2, 4, 5), (20, 5, 1), (2, 3, 5), (15, 5, 1)) is None
    # a column-major output
    assert gemm.plan((2, 3, 4), (12, 4, 1), (2, 4, 5), (20, 5, 1), (2, 3, 5), (15, 1, 3)) is None
    # mismatched shapes
    assert gemm.plan((2, 3, 4), (12, 4, 1), (2, 5, 5), (25, 5, 1), (2, 3, 5), (15, 5, 1)) is None


def test_two_dimensional_transposed_product(rng):
    # linear backward's dw += x^T dy: one call, no batch
    x = rng.standard_normal((7, 3))
    dy = rng.standard_normal((7, 5))
    dw = rng.standard_normal((3, 5))
    calls = check(x.T, x, dy, dy, dw, dw, accumulate=True)
    assert len(calls) == 1 and calls[0].batch == 1


def test_overlap_is_seen():
    class View:          # the attributes gemm.span reads from a CuPy array
        def __init__(self, ptr, shape, strides, itemsize=8):
            self.data, self.shape, self.strides, self.itemsize = type("P", (), {"ptr": ptr})(), shape, strides, itemsize
    a = View(1000, (4, 4), (32, 8))                  # bytes 1000 .. 1128
    assert gemm._overlaps(a, View(1120, (2,), (8,)))
    assert not gemm._overlaps(a, View(1128, (2,), (8,)))
    assert gemm._overlaps(a, View(1200, (4, 4), (-32, 8)))   # a negative stride reaches back to 1104
