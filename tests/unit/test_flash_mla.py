"""Flash attention with values of another head width than the queries and keys (multi-head latent attention):
the NumPy twin (nn/flash.py) against the standard grouped core (nn/gqa.py) and finite differences in float64, with
and without packed documents; the kernels (nn/flash_cuda.py, v zero-padded to the q/k width) on the CuPy stand-in
against the twin, float64, float32, bfloat16 bits and the tensor-core entries."""
from __future__ import annotations

import math

import emulated_cupy
import numpy as np
import pytest

from hpengine.nn import Numerics, flash
from hpengine.nn.gqa import gqa_attention_backward, gqa_attention_forward
from test_flash_documents import ids
from test_layers import numgrad

TOL = dict(rtol=1e-12, atol=1e-12)


def inputs(seed, B, H, K, T, hd, dv):
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, H, T, hd)) * 2 / math.sqrt(hd)
    k = r.standard_normal((B, K, T, hd))
    vbase = r.standard_normal((B, T, K * dv))
    dy = r.standard_normal((B, T, H * dv))
    return q, k, vbase, vbase.reshape(B, T, K, dv).transpose(0, 2, 1, 3), dy     # v: strided, per head


def rel_err(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(a) + np.linalg.norm(b), 1e-30)


# (B, H, K, T, hd, dv, bq, bk): values narrower and wider than q/k, groups 1 and 2, blocks not dividing T
CASES = [(2, 2, 2, 7, 6, 4, 3, 2), (1, 4, 2, 9, 5, 3, 2, 4), (2, 3, 3, 6, 3, 5, 4, 4), (1, 2, 1, 5, 4, 1, 1, 1)]


@pytest.mark.parametrize("B,H,K,T,hd,dv,bq,bk", CASES)
def test_narrow_values_equal_the_standard_core(B, H, K, T, hd, dv, bq, bk):
    q, k, _, v, dy = inputs(1, B, H, K, T, hd, dv)
    y, c = gqa_attention_forward(np, q, k, v)
    yf, cf = flash.flash_gqa_forward(np, q, k, v, bq, bk)
    assert yf.shape == (B, T, H * dv)
    np.testing.assert_allclose(yf, y, **TOL)
    for got, want in zip(flash.flash_gqa_backward(np, dy, cf), gqa_attention_backward(np, dy, c)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("B,H,K,T,hd,dv,bq,bk", [(1, 4, 2, 6, 3, 2, 4, 3), (1, 2, 2, 5, 2, 3, 2, 2)])
def test_narrow_values_fd(B, H, K, T, hd, dv, bq, bk):
    q, k, vbase, v, ry = inputs(2, B, H, K, T, hd, dv)
    _, cache = flash.flash_gqa_forward(np, q, k, v, bq, bk)
    dq, dk, dvg = flash.flash_gqa_backward(np, ry, cache)
    f = lambda: np.sum(flash.flash_gqa_forward(np, q, k, v, bq, bk)[0] * ry)          # noqa: E731
    for x, ana, what in [(q, dq, "dq"), (k, dk, "dk"), (vbase, dvg.transpose(0, 2, 1, 3).reshape(B, T, K * dv), "dv")]:
        num = numgrad(f, x)
        assert rel_err(num, ana) < 1e-8 and np.linalg.norm(num) > 1e-3, what


ROWS = [[30, 5, 40, 25], [1, 64, 31, 4]]            # T 100: boundaries on and off the tiles, a document of one


@pytest.mark.parametrize("bq,bk", [(None, None), (16, 8), (7, 5)])
def test_narrow_values_with_packed_documents_equal_the_standard_core(bq, bk):
    B, H, K, T, hd, dv = 2, 4, 2, 100, 6, 4
    q, k, _, v, dy = inputs(3, B, H, K, T, hd, dv)
    seg = ids(ROWS)
    y, c = gqa_attention_forward(np, q, k, v, segments=seg)
    yf, cf = flash.flash_gqa_forward(np, q, k, v, bq, bk, segments=seg)
    np.testing.assert_allclose(yf, y, **TOL)
    for got, want in zip(flash.flash_gqa_backward(np, dy, cf, segments=seg), gqa_attention_backward(np, dy, c)):
        np.testing.assert_allclose(got, want, **TOL)
    # the document mask matters here: without it the output differs
    assert not np.allclose(flash.flash_gqa_forward(np, q, k, v, bq, bk)[0], y)


def test_narrow_values_fd_with_documents():
    B, H, K, T, hd, dv = 1, 2, 1, 7, 3, 2
    q, k, vbase, v, ry = inputs(4, B, H, K, T, hd, dv)
    seg = ids([[3, 4]])
    _, cache = flash.flash_gqa_forward(np, q, k, v, 2, 3, segments=seg)
    grads = flash.flash_gqa_backward(np, ry, cache, segments=seg)
    f = lambda: np.sum(flash.flash_gqa_forward(np, q, k, v, 2, 3, segments=seg)[0] * ry)     # noqa: E731
    for x, ana in [(q, grads[0]), (k, grads[1]), (vbase, grads[2].transpose(0, 2, 1, 3).reshape(B, T, K * dv))]:
        num = numgrad(f, x)
        assert rel_err(num, ana) < 1e-8 and np.linalg.norm(num) > 1e-3


# ---- the kernels on the CuPy stand-in (their C code emulated), v zero-padded to the q/k width by flash_cuda

def _on_device(cp, q, k, v, dy, num, segments=None, cast=None):
    cast = cast or (lambda a: cp.asarray(np.ascontiguousarray(a)))
    B, T, K, dv = v.shape[0], v.shape[2], v.shape[1], v.shape[3]
    vd = cast(v.transpose(0, 2, 1, 3).reshape(B, T, K * dv)).reshape(B, T, K, dv).transpose(0, 2, 1, 3)
    seg = None if segments is None else cp.asarray(segments)
    y, c = flash.flash_gqa_forward(cp, cast(q), cast(k), vd, num=num, segments=seg)
    grads = flash.flash_gqa_backward(cp, cast(dy), c, num=num, segments=seg)
    return [np.asarray(a.get()) for a in (y, c[4], *grads)]


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("documents", [False, True])
def test_kernels_with_narrow_values_equal_the_twin(monkeypatch, dtype, tol, documents):
    B, H, K, T, hd, dv = 2, 4, 2, 100, 12, 8
    q, k, _, v, dy = inputs(5, B, H, K, T, hd, dv)
    seg = ids(ROWS) if documents else None
    y, c = flash.flash_gqa_forward(np, q, k, v, segments=seg)
    want = [y, c[4], *flash.flash_gqa_backward(np, dy, c, segments=seg)]
    cp = emulated_cupy.install(monkeypatch)
    got = _on_device(cp, *(a.astype(dtype) for a in (q, k, v, dy)), Numerics(), seg)
    suffix = "f64" if dtype == np.float64 else "f32"
    assert {f"flash_{op}_{suffix}" for op in ("fwd", "bwd_dq", "bwd_dkdv")} <= set(cp.launches)
    for name, g, w in zip(("y", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == dtype, name
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=name)


def test_narrow_values_through_the_kernels_are_the_padded_values_run(monkeypatch):
    """The padding is exact: the kernels on v narrower than q/k give the very bits of the kernels on v padded
    with zero columns, cut to dv (and a launch on the padded values is what the narrow one makes)."""
    B, H, K, T, hd, dv = 1, 2, 2, 20, 8, 5
    q, k, _, v, dy = inputs(6, B, H, K, T, hd, dv)
    cp = emulated_cupy.install(monkeypatch)
    narrow = _on_device(cp, q, k, v, dy, Numerics())
    vp = np.concatenate([v, np.zeros(v.shape[:3] + (hd - dv,))], axis=-1)
    dyp = np.concatenate([dy.reshape(B, T, H, dv), np.zeros((B, T, H, hd - dv))], axis=-1).reshape(B, T, H * hd)
    wide = _on_device(cp, q, k, vp, dyp, Numerics())
    cut = lambda a: a.reshape(a.shape[:-1] + (-1, hd))[..., :dv].reshape(a.shape[:-1] + (-1,))     # noqa: E731
    np.testing.assert_array_equal(narrow[0], cut(wide[0]))
    for n, w in zip(narrow[1:4], wide[1:4]):
        np.testing.assert_array_equal(n, w)
    np.testing.assert_array_equal(narrow[4], wide[4][..., :dv])
    assert not wide[4][..., dv:].any() and not wide[0].reshape(B, T, H, hd)[..., dv:].any()    # exact zeros


@pytest.mark.parametrize("storage", ["f32", "bf16"])
def test_tensor_core_entries_with_narrow_values_follow_the_twin(monkeypatch, storage):
    """Under bf16 amp the tensor-core entries (bf16 operands, float32 sums) against the twin's bf16 products,
    within the bfloat16 steps the sums' order can move (as tests/unit/test_emulated_kernels.py)."""
    B, H, K, T, hd, dv = 1, 4, 2, 40, 24, 16
    r16 = lambda a: flash.flash_cuda.from_bf16(np, flash.flash_cuda.to_bf16(np, a.astype(np.float32)))  # noqa: E731
    q, k, v, dy = (r16(a) for a in (lambda t: (t[0], t[1], t[3], t[4]))(inputs(7, B, H, K, T, hd, dv)))
    num = Numerics(bf16=True)
    y, c = flash.flash_gqa_forward(np, q, k, v, num=num)
    want = [y, c[4], *flash.flash_gqa_backward(np, dy.copy(), c, num)]
    cp = emulated_cupy.install(monkeypatch)
    cast = (lambda a: flash.flash_cuda.to_bf16(cp, cp.asarray(np.ascontiguousarray(a)))) if storage == "bf16" else None
    got = _on_device(cp, q, k, v, dy, num, cast=cast)
    assert {f"flash_mma_{op}_{storage}_hd64" for op in ("fwd", "bwd_dq", "bwd_dkdv")} <= set(cp.launches)
    for name, g, w in zip(("y", "lse", "dq", "dk", "dv"), got, want):
        g = flash.flash_cuda.from_bf16(np, g) if g.dtype == np.uint16 else g
        w = flash.flash_cuda.from_bf16(np, w) if w.dtype == np.uint16 else w
        assert g.shape == w.shape, name
        big = np.abs(w).max()
        assert np.abs(g - w).max() <= big * 2 ** -6, (name, np.abs(g - w).max(), big)
