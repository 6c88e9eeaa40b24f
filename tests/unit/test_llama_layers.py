"""Finite-difference, closed-form and dtype tests for the Llama layers of hpengine.nn: RMSNorm, rotary
embedding, SwiGLU gating and grouped-query attention (NumPy, float64 unless noted).

Every backward is checked by central differences of sum(y * r) for a fixed random r; every forward
against a closed form or a naive loop written here, never against a copy of the layer's own code.
"""
import math

import numpy as np
import pytest

from hpengine.layout.cache import cache_nbytes
from test_layers import numgrad  # central differences (tests/unit/test_layers.py)
from hpengine.nn import attention_forward, attention_backward, score_elements
from hpengine.nn.gqa import gqa_attention_backward, gqa_attention_forward, gqa_cache_elements
from hpengine.nn.rmsnorm import rmsnorm_backward, rmsnorm_cache_bytes, rmsnorm_forward
from hpengine.nn.rope import rope_backward, rope_forward, rope_tables
from hpengine.nn.swiglu import swiglu_backward, swiglu_forward, swiglu_recompute

FD_TOL = 1e-6


def rng(seed=0):
    return np.random.default_rng(seed)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def assert_close_grad(num, ana, what, zero=False):
    """ana matches the central differences num; zero: the true gradient is identically zero."""
    assert num.shape == ana.shape, (what, num.shape, ana.shape)
    if zero:
        assert np.abs(num).max() < 1e-9 and np.abs(ana).max() < 1e-12, f"{what}: expected a zero gradient"
        return
    err = np.linalg.norm(num - ana) / max(np.linalg.norm(num) + np.linalg.norm(ana), 1e-30)
    assert err < FD_TOL, f"{what}: relative error {err:.3e}"
    assert np.linalg.norm(num) > 1e-8, f"{what}: gradient is trivially zero"


# --------------------------------------------------------------- rmsnorm

def rms_ref(x, w, eps):
    x = np.asarray(x, np.float64)
    return np.asarray(w, np.float64) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("shape", [(2, 5, 8), (1, 1, 6), (3, 7, 2), (4, 3)])
@pytest.mark.parametrize("eps", [1e-5, 0.3])
def test_rmsnorm_forward_and_fd(shape, eps):
    r = rng(1)
    x = r.standard_normal(shape) * 1.5 + 0.2
    w = r.standard_normal(shape[-1])
    ry = r.standard_normal(shape)
    y, cache = rmsnorm_forward(np, x, w, eps)
    np.testing.assert_allclose(y, rms_ref(x, w, eps), rtol=1e-12, atol=1e-13)
    dw = np.zeros_like(w)
    dx = rmsnorm_backward(np, ry, cache, w, dw)
    assert dx.shape == x.shape
    f = lambda: np.sum(rmsnorm_forward(np, x, w, eps)[0] * ry)
    assert_close_grad(numgrad(f, x), dx, "rmsnorm dx")
    assert_close_grad(numgrad(f, w), dw, "rmsnorm dw")


def test_rmsnorm_eps_honoured_and_default():
    x = np.array([[1e-3, -2e-3, 3e-3, 0.0], [1.0, 2.0, -3.0, 4.0]])
    w = np.array([1.0, 2.0, 0.5, -1.0])
    for eps in (1e-5, 1e-2, 1.0):
        np.testing.assert_allclose(rmsnorm_forward(np, x, w, eps)[0], rms_ref(x, w, eps), rtol=1e-13)
    np.testing.assert_allclose(rmsnorm_forward(np, x, w)[0], rms_ref(x, w, 1e-5), rtol=1e-13)
    # the tiny row is dominated by eps: a large eps makes it visibly smaller than a small one
    big, small = rmsnorm_forward(np, x, w, 1.0)[0][0], rmsnorm_forward(np, x, w, 1e-5)[0][0]
    assert np.abs(big).max() < 0.1 * np.abs(small).max()


def test_rmsnorm_backward_accumulates_and_keeps_cache():
    r = rng(2)
    x, w, dy = r.standard_normal((2, 5, 6)), r.standard_normal(6), r.standard_normal((2, 5, 6))
    _, cache = rmsnorm_forward(np, x, w)
    g = np.zeros(6)
    dx0 = rmsnorm_backward(np, dy, cache, w, g)
    pre = r.standard_normal(6)
    dw = pre.copy()
    rmsnorm_backward(np, dy, cache, w, dw)
    dx1 = rmsnorm_backward(np, dy, cache, w, dw)
    np.testing.assert_allclose(dw, pre + 2 * g, rtol=1e-12)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-12)


def pure_f16_rmsnorm(x, w, eps):
    # every step in float16: the statistic overflows once sum(x^2) passes 65504
    x = x.astype(np.float16)
    with np.errstate(over="ignore"):
        ms = (x * x).sum(axis=-1, keepdims=True, dtype=np.float16) / np.float16(x.shape[-1]) + np.float16(eps)
    return (x * (np.float16(1) / np.sqrt(ms))).astype(np.float16) * w


@pytest.mark.parametrize("scale", [1.0, 60.0])
def test_rmsnorm_float16_statistics_in_float32(scale):
    r = rng(3)
    x = (r.standard_normal((3, 5, 64)) * scale).astype(np.float16)
    w = (r.standard_normal(64) * 0.5 + 1).astype(np.float16)
    y, (xhat, rstd) = rmsnorm_forward(np, x, w)
    assert y.dtype == np.float16 and xhat.dtype == np.float16 and rstd.dtype == np.float32
    x64 = x.astype(np.float64)
    rstd64 = 1 / np.sqrt(np.mean(x64 * x64, axis=-1) + 1e-5)
    np.testing.assert_allclose(rstd.reshape(-1), rstd64.reshape(-1), rtol=2e-6)  # float16 would be ~5e-4
    ref = rms_ref(x, w, 1e-5)
    err, err_pure = rel_err(y, ref), rel_err(pure_f16_rmsnorm(x, w, 1e-5), ref)
    assert err < 2e-3, err
    assert err < err_pure, (err, err_pure)
    if scale > 1:  # sum(x^2) ~ 2e5 overflows float16: the pure-half computation collapses
        assert err_pure > 0.5


def test_rmsnorm_float16_backward():
    r = rng(4)
    x = r.standard_normal((2, 7, 16)).astype(np.float16)
    w = (r.standard_normal(16) + 1).astype(np.float16)
    dy = r.standard_normal((2, 7, 16)).astype(np.float16)
    _, cache = rmsnorm_forward(np, x, w)
    dw = np.zeros(16, np.float16)
    dx = rmsnorm_backward(np, dy, cache, w, dw)
    assert dx.dtype == np.float16 and dw.dtype == np.float16
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    _, c64 = rmsnorm_forward(np, x64, w64)
    dw64 = np.zeros(16)
    dx64 = rmsnorm_backward(np, dy64, c64, w64, dw64)    # float64 path, checked against FD above
    assert rel_err(dx, dx64) < 1e-2 and rel_err(dw, dw64) < 1e-2


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("shape", [(2, 5, 8), (1, 1, 4), (3, 7, 6)])
def test_rmsnorm_cache_bytes(dtype, shape):
    r = rng(5)
    x = r.standard_normal(shape).astype(dtype)
    w = r.standard_normal(shape[-1]).astype(dtype)
    _, cache = rmsnorm_forward(np, x, w)
    n = int(np.prod(shape[:-1]))
    assert cache_nbytes(cache, set()) == rmsnorm_cache_bytes(n, shape[-1], np.dtype(dtype).itemsize)


# ------------------------------------------------------------------ rope

def test_rope_tables_closed_form_and_odd_hd():
    cos, sin = rope_tables(np, 6, 8, 10000.0, np.float64)
    assert cos.shape == sin.shape == (6, 4)
    for t, i in [(0, 0), (1, 0), (3, 2), (5, 3), (4, 1)]:
        ang = t * 10000.0 ** (-2 * i / 8)
        assert math.isclose(cos[t, i], math.cos(ang), rel_tol=1e-14, abs_tol=1e-15)
        assert math.isclose(sin[t, i], math.sin(ang), rel_tol=1e-14, abs_tol=1e-15)
    c3, s3 = rope_tables(np, 6, 8, 10000.0, np.float64, scale=0.25)
    np.testing.assert_allclose(c3, 0.25 * cos, rtol=1e-15)
    np.testing.assert_allclose(s3, 0.25 * sin, rtol=1e-15)
    for hd in (5, 1):
        with pytest.raises(ValueError, match=rf"\b{hd}\b"):
            rope_tables(np, 4, hd, 10000.0, np.float64)


@pytest.mark.parametrize("hd", [2, 8])
def test_rope_forward_closed_form(hd):
    B, T, H, theta = 2, 5, 3, 500.0
    r = rng(6)
    x = r.standard_normal((B, T, H, hd))
    cos, sin = rope_tables(np, T, hd, theta, np.float64)
    y = rope_forward(np, x, cos, sin)
    assert y.shape == (B, H, T, hd) and y.flags.c_contiguous
    h2 = hd // 2
    for b, t, h, i in [(0, 0, 0, 0), (1, 3, 2, h2 - 1), (0, 4, 1, 0), (1, 2, 0, h2 // 2)]:
        a = t * theta ** (-2 * i / hd)
        x1, x2 = x[b, t, h, i], x[b, t, h, i + h2]
        assert math.isclose(y[b, h, t, i], x1 * math.cos(a) - x2 * math.sin(a), rel_tol=1e-12, abs_tol=1e-14)
        assert math.isclose(y[b, h, t, i + h2], x2 * math.cos(a) + x1 * math.sin(a),
                            rel_tol=1e-12, abs_tol=1e-14)
    np.testing.assert_allclose(y[:, :, 0], x[:, 0], rtol=1e-15)  # position 0: identity
    # a unit vector in slot i at position t lands on (cos, sin) of its angle
    e = np.zeros((1, T, 1, hd))
    e[0, 4, 0, h2 - 1] = 1.0
    ye = rope_forward(np, e, cos, sin)[0, 0, 4]
    a = 4 * theta ** (-2 * (h2 - 1) / hd)
    np.testing.assert_allclose([ye[h2 - 1], ye[-1]], [math.cos(a), math.sin(a)], rtol=1e-14)
    assert np.count_nonzero(ye) == 2
    # each pair keeps its norm
    xt = x.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(y[..., :h2] ** 2 + y[..., h2:] ** 2, xt[..., :h2] ** 2 + xt[..., h2:] ** 2,
                               rtol=1e-12)


def test_rope_backward_is_inverse_and_scale_multiplies():
    B, T, H, hd = 2, 7, 2, 6
    r = rng(7)
    x = r.standard_normal((B, T, H, hd))
    cos, sin = rope_tables(np, T + 3, hd, 10000.0, np.float64)  # longer tables: rows [:T] are used
    y = rope_forward(np, x, cos, sin)
    back = rope_backward(np, y, cos, sin)
    assert back.shape == x.shape
    np.testing.assert_allclose(back, x, rtol=1e-12, atol=1e-14)
    cs, ss = rope_tables(np, T, hd, 10000.0, np.float64, scale=0.3)
    np.testing.assert_allclose(rope_forward(np, x, cs, ss), 0.3 * y, rtol=1e-12, atol=1e-15)
    dy = r.standard_normal((B, H, T, hd))
    np.testing.assert_allclose(rope_backward(np, dy, cs, ss), 0.3 * rope_backward(np, dy, cos, sin),
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("B,T,H,hd", [(2, 5, 3, 2), (1, 1, 2, 4), (1, 7, 1, 8), (2, 4, 2, 6)])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_rope_fd(B, T, H, hd, scale):
    r = rng(8)
    base = r.standard_normal((B, T, 3 * H * hd))  # x: a strided (B, T, H, hd) view, like a fused projection
    x = base.reshape(B, T, 3, H, hd)[:, :, 1]
    cos, sin = rope_tables(np, T, hd, 100.0, np.float64, scale=scale)
    ry = r.standard_normal((B, H, T, hd))
    dx = rope_backward(np, ry, cos, sin)
    f = lambda: np.sum(rope_forward(np, x, cos, sin) * ry)
    num = numgrad(f, base).reshape(B, T, 3, H, hd)
    assert not num[:, :, [0, 2]].any()
    assert_close_grad(num[:, :, 1], dx, "rope dx")


# ---------------------------------------------------------------- swiglu

@pytest.mark.parametrize("shape", [(2, 5, 8), (1, 1, 3), (7,)])
def test_swiglu_forward_recompute_fd(shape):
    r = rng(9)
    g, u = r.standard_normal(shape) * 2, r.standard_normal(shape)
    ra = r.standard_normal(shape)
    a, cache = swiglu_forward(np, g, u)
    np.testing.assert_allclose(a, g / (1 + np.exp(-g)) * u, rtol=1e-13, atol=1e-15)
    np.testing.assert_array_equal(swiglu_recompute(np, cache), a)
    dg, du = swiglu_backward(np, ra, cache)
    f = lambda: np.sum(swiglu_forward(np, g, u)[0] * ra)
    assert_close_grad(numgrad(f, g), dg, "swiglu dg")
    assert_close_grad(numgrad(f, u), du, "swiglu du")


def test_swiglu_values_and_recompute_float16():
    a, _ = swiglu_forward(np, np.array([0.0, 1.0, -2.0]), np.array([5.0, 2.0, 3.0]))
    np.testing.assert_allclose(a, [0.0, 2 / (1 + math.exp(-1)), -6 / (1 + math.exp(2))], rtol=1e-14)
    r = rng(10)
    g, u = (r.standard_normal((3, 7)).astype(np.float16) for _ in range(2))
    a, cache = swiglu_forward(np, g, u)
    assert a.dtype == np.float16
    np.testing.assert_array_equal(swiglu_recompute(np, cache), a)


# ------------------------------------------------------------------- gqa

def naive_gqa(q, k, v):
    """Loop reference: query head h reads kv head h // (H/K), causal softmax per (b, h, t)."""
    B, H, T, hd = q.shape
    g = H // k.shape[1]
    y = np.zeros((B, T, H, hd))
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, h // g], v[b, h // g]
            for t in range(T):
                s = kh[: t + 1] @ q[b, h, t]
                p = np.exp(s - s.max())
                y[b, t, h] = (p / p.sum()) @ vh[: t + 1]
    return y.reshape(B, T, H * hd)


def gqa_inputs(r, B, H, K, T, hd, dtype=np.float64):
    q = (r.standard_normal((B, H, T, hd)) / math.sqrt(hd)).astype(dtype)
    k = r.standard_normal((B, K, T, hd)).astype(dtype)
    vbase = r.standard_normal((B, T, K * hd)).astype(dtype)
    v = vbase.reshape(B, T, K, hd).transpose(0, 2, 1, 3)   # the projection's output seen per head
    return q, k, vbase, v


# (B, H, K, T, hd): g = H / K in {1, 2, 3, 4}, K = 1 multi-query, odd T, hd = 2
GQA_SHAPES = [(2, 2, 2, 5, 4), (1, 4, 2, 7, 2), (2, 6, 2, 5, 3), (1, 3, 1, 7, 4), (2, 2, 1, 1, 2),
              (1, 4, 1, 6, 2), (1, 3, 3, 1, 2)]


@pytest.mark.parametrize("B,H,K,T,hd", GQA_SHAPES)
def test_gqa_matches_naive(B, H, K, T, hd):
    q, k, vbase, v = gqa_inputs(rng(11), B, H, K, T, hd)
    y, _ = gqa_attention_forward(np, q, k, v)
    assert y.shape == (B, T, H * hd)
    np.testing.assert_allclose(y, naive_gqa(q, k, v), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("B,H,K,T,hd", GQA_SHAPES)
def test_gqa_fd(B, H, K, T, hd):
    r = rng(12)
    q, k, vbase, v = gqa_inputs(r, B, H, K, T, hd)
    saved = [a.copy() for a in (q, k, vbase)]
    ry = r.standard_normal((B, T, H * hd))
    _, cache = gqa_attention_forward(np, q, k, v)
    dq, dk, dv = gqa_attention_backward(np, ry, cache)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    for a, s in zip((q, k, vbase), saved):   # neither pass writes into its inputs
        np.testing.assert_array_equal(a, s)
    f = lambda: np.sum(gqa_attention_forward(np, q, k, v)[0] * ry)
    # one position: softmax over a single key is 1 whatever q and k are: dq, dk are zero (up to rounding)
    assert_close_grad(numgrad(f, q), dq, "gqa dq", zero=T == 1)
    assert_close_grad(numgrad(f, k), dk, "gqa dk", zero=T == 1)
    assert_close_grad(numgrad(f, vbase), dv.transpose(0, 2, 1, 3).reshape(B, T, K * hd), "gqa dv")


@pytest.mark.parametrize("T", [1, 5, 6])
def test_gqa_equals_attention_when_k_equals_h(T):
    B, H, hd = 2, 3, 4
    r = rng(13)
    qkv = r.standard_normal((B, T, H * 3 * hd))
    parts = qkv.reshape(B, T, H, 3, hd)
    q, k, v = (parts[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
    y, cache = gqa_attention_forward(np, q / math.sqrt(hd), k, v)
    y_ref, cache_ref = attention_forward(np, qkv, H)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-13)
    dy = r.standard_normal((B, T, H * hd))
    dq, dk, dv = gqa_attention_backward(np, dy, cache)
    d = attention_backward(np, dy, cache_ref).reshape(B, T, H, 3, hd).transpose(0, 2, 3, 1, 4)
    np.testing.assert_allclose(dq / math.sqrt(hd), d[:, :, 0], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dk, d[:, :, 1], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dv, d[:, :, 2], rtol=1e-12, atol=1e-13)


def test_gqa_rejects_uneven_groups():
    q, k, _, v = gqa_inputs(rng(14), 1, 3, 2, 4, 2)
    with pytest.raises(ValueError):
        gqa_attention_forward(np, q, k, v)


@pytest.mark.parametrize("B,H,K,T,hd", [(2, 4, 2, 7, 8), (1, 3, 1, 5, 16), (2, 4, 4, 6, 8)])
def test_gqa_float16(B, H, K, T, hd):
    r = rng(15)
    q, k, vbase, v = gqa_inputs(r, B, H, K, T, hd)
    dy = r.standard_normal((B, T, H * hd))
    y64, c64 = gqa_attention_forward(np, q, k, v)          # float64 path, checked against naive and FD
    grads64 = gqa_attention_backward(np, dy, c64)
    h = [a.astype(np.float16) for a in (q, k, vbase, dy)]
    v16 = h[2].reshape(B, T, K, hd).transpose(0, 2, 1, 3)
    y16, c16 = gqa_attention_forward(np, h[0], h[1], v16)
    assert y16.dtype == np.float16
    assert rel_err(y16, y64) < 1e-2
    grads16 = gqa_attention_backward(np, h[3], c16)
    for name, a16, a64 in zip(("dq", "dk", "dv"), grads16, grads64):
        assert a16.dtype == np.float16, name
        assert np.isfinite(a16).all(), name
        assert rel_err(a16, a64) < 1e-2, (name, rel_err(a16, a64))


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
@pytest.mark.parametrize("B,H,K,T,hd", GQA_SHAPES)
def test_gqa_cache_elements(B, H, K, T, hd, dtype):
    q, k, vbase, v = gqa_inputs(rng(16), B, H, K, T, hd, dtype)
    _, cache = gqa_attention_forward(np, q, k, v)
    want = gqa_cache_elements(B, T, H, K, hd, score_elements(T)) * np.dtype(dtype).itemsize
    assert cache_nbytes(cache, set()) == want
