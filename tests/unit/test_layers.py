"""Finite-difference and property tests for hpengine.nn (NumPy, float64 unless noted).

Every backward is checked by central differences against sum(y * r) for a fixed
random r, with respect to every input and parameter.
"""
import math

import numpy as np
import pytest

from hpengine import nn

B, T, C, H, V = 2, 5, 8, 2, 11
FD_EPS = 1e-6
FD_TOL = 1e-6


def rng(seed=0):
    return np.random.default_rng(seed)


def numgrad(f, a):
    """Central-difference gradient of scalar f() with respect to array a (perturbed in place)."""
    g = np.zeros_like(a)
    flat, gflat = a.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + FD_EPS
        fp = f()
        flat[i] = old - FD_EPS
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * FD_EPS)
    return g


def assert_close_grad(num, ana, what):
    assert num.shape == ana.shape, what
    err = np.linalg.norm(num - ana) / max(np.linalg.norm(num) + np.linalg.norm(ana), 1e-30)
    assert err < FD_TOL, f"{what}: relative error {err:.3e}"
    assert np.linalg.norm(num) > 1e-8, f"{what}: gradient is trivially zero"


class StrictGrad(np.ndarray):
    """Grad array that refuses in-place adds of another dtype (catches hidden upcasts)."""

    def __iadd__(self, other):
        if isinstance(other, np.ndarray):
            assert other.dtype == self.dtype, f"+= of {other.dtype} into {self.dtype}"
        return super().__iadd__(other)


def strict_zeros(shape, dtype):
    return np.zeros(shape, dtype).view(StrictGrad)


# ---------------------------------------------------------------- linear

@pytest.mark.parametrize("bias", [True, False])
def test_linear_fd(bias):
    r = rng(1)
    x = r.standard_normal((B, T, C))
    w = r.standard_normal((C, 6))
    b = r.standard_normal(6) if bias else None
    ry = r.standard_normal((B, T, 6))
    y, cache = nn.linear_forward(np, x, w, b)
    np.testing.assert_allclose(y, x @ w + (b if bias else 0), rtol=1e-12)
    dw = np.zeros_like(w)
    db = np.zeros(6) if bias else None
    dx = nn.linear_backward(np, ry, cache, w, dw, db)
    f = lambda: np.sum(nn.linear_forward(np, x, w, b)[0] * ry)
    assert_close_grad(numgrad(f, x), dx, "dx")
    assert_close_grad(numgrad(f, w), dw, "dw")
    if bias:
        assert_close_grad(numgrad(f, b), db, "db")


def test_linear_accumulates():
    r = rng(2)
    x, w, b = r.standard_normal((B, T, C)), r.standard_normal((C, 4)), r.standard_normal(4)
    dy = r.standard_normal((B, T, 4))
    _, cache = nn.linear_forward(np, x, w, b)
    dw0, db0 = np.zeros_like(w), np.zeros_like(b)
    nn.linear_backward(np, dy, cache, w, dw0, db0)
    pw, pb = r.standard_normal(w.shape), r.standard_normal(b.shape)
    dw, db = pw.copy(), pb.copy()
    nn.linear_backward(np, dy, cache, w, dw, db)
    nn.linear_backward(np, dy, cache, w, dw, db)
    np.testing.assert_allclose(dw, pw + 2 * dw0, rtol=1e-12)
    np.testing.assert_allclose(db, pb + 2 * db0, rtol=1e-12)


# ------------------------------------------------------------- embedding

def test_embedding_fd_and_lookup():
    r = rng(3)
    idx = r.integers(0, V, (B, T))
    w = r.standard_normal((V, C))
    ry = r.standard_normal((B, T, C))
    y, cache = nn.embedding_forward(np, idx, w)
    np.testing.assert_array_equal(y, w[idx])
    dw = np.zeros_like(w)
    assert nn.embedding_backward(np, ry, cache, dw) is None
    f = lambda: np.sum(nn.embedding_forward(np, idx, w)[0] * ry)
    assert_close_grad(numgrad(f, w), dw, "dw")


def test_embedding_repeated_ids():
    r = rng(4)
    idx = np.array([[3, 3, 3, 1, 3], [1, 0, 3, 10, 10]])
    w = r.standard_normal((V, C))
    dy = r.standard_normal((B, T, C))
    _, cache = nn.embedding_forward(np, idx, w)
    dw = np.zeros_like(w)
    nn.embedding_backward(np, dy, cache, dw)
    ref = np.zeros_like(w)
    np.add.at(ref, idx.reshape(-1), dy.reshape(-1, C))
    np.testing.assert_allclose(dw, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dw[3], dy[0, [0, 1, 2, 4]].sum(0) + dy[1, 2], rtol=1e-12)


def test_embedding_vocab_start():
    r = rng(5)
    idx = r.integers(0, V, (B, T))
    idx[0, :3] = [2, 3, 7]  # both edges of the shard [3, 7) plus one inside
    w_full = r.standard_normal((V, C))
    start, stop = 3, 7
    w = w_full[start:stop].copy()
    dy = r.standard_normal((B, T, C))
    y, cache = nn.embedding_forward(np, idx, w, vocab_start=start)
    inside = (idx >= start) & (idx < stop)
    assert inside.any() and (~inside).any()
    np.testing.assert_array_equal(y[inside], w_full[idx[inside]])
    np.testing.assert_array_equal(y[~inside], 0.0)
    dw = np.zeros_like(w)
    nn.embedding_backward(np, dy, cache, dw)
    ref = np.zeros_like(w_full)
    np.add.at(ref, idx[inside], dy[inside])
    np.testing.assert_allclose(dw, ref[start:stop], rtol=1e-12, atol=1e-14)
    f = lambda: np.sum(nn.embedding_forward(np, idx, w, vocab_start=start)[0] * dy)
    assert_close_grad(numgrad(f, w), dw, "dw (vocab_start)")


def test_embedding_vocab_split_sums_to_full():
    r = rng(6)
    idx = r.integers(0, V, (B, T))
    w = r.standard_normal((V, C))
    dy = r.standard_normal((B, T, C))
    y_full, c_full = nn.embedding_forward(np, idx, w)
    dw_full = np.zeros_like(w)
    nn.embedding_backward(np, dy, c_full, dw_full)
    y_sum, dws = 0.0, []
    for lo, hi in [(0, 6), (6, V)]:
        y, c = nn.embedding_forward(np, idx, w[lo:hi], vocab_start=lo)
        dw = np.zeros((hi - lo, C))
        nn.embedding_backward(np, dy, c, dw)
        y_sum = y_sum + y
        dws.append(dw)
    np.testing.assert_array_equal(y_sum, y_full)
    np.testing.assert_allclose(np.concatenate(dws), dw_full, rtol=1e-12, atol=1e-14)


def test_embedding_accumulates():
    r = rng(7)
    idx = r.integers(0, V, (B, T))
    w, dy = r.standard_normal((V, C)), r.standard_normal((B, T, C))
    _, cache = nn.embedding_forward(np, idx, w)
    g = np.zeros_like(w)
    nn.embedding_backward(np, dy, cache, g)
    pre = r.standard_normal(w.shape)
    dw = pre.copy()
    nn.embedding_backward(np, dy, cache, dw)
    nn.embedding_backward(np, dy, cache, dw)
    np.testing.assert_allclose(dw, pre + 2 * g, rtol=1e-12)


def test_embedding_grad_lands_in_views():
    r = rng(19)
    idx = np.array([[1, 4, 4, 0, 9], [4, 4, 2, 1, 12]])  # 12 is out of range
    w, dy = r.standard_normal((V, C)), r.standard_normal((B, T, C))
    _, cache = nn.embedding_forward(np, idx, w)
    ref = np.zeros_like(w)
    nn.embedding_backward(np, dy, cache, ref)
    flat = np.zeros(3 + V * C)  # contiguous view into a flat buffer, at an offset
    nn.embedding_backward(np, dy, cache, flat[3:].reshape(V, C))
    np.testing.assert_allclose(flat[3:].reshape(V, C), ref, rtol=1e-12)
    assert flat[:3].sum() == 0.0
    wide = np.zeros((V, 2 * C))  # non-contiguous view
    nn.embedding_backward(np, dy, cache, wide[:, C:])
    np.testing.assert_allclose(wide[:, C:], ref, rtol=1e-12)
    assert not wide[:, :C].any()


# ------------------------------------------------------------- layernorm

def test_layernorm_fd():
    r = rng(8)
    x = r.standard_normal((B, T, C)) * 2 + 0.5
    w, b = r.standard_normal(C), r.standard_normal(C)
    ry = r.standard_normal((B, T, C))
    y, cache = nn.layernorm_forward(np, x, w, b)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(y, (x - mu) / np.sqrt(var + 1e-5) * w + b, rtol=1e-12, atol=1e-12)
    dw, db = np.zeros_like(w), np.zeros_like(b)
    dx = nn.layernorm_backward(np, ry, cache, w, dw, db)
    f = lambda: np.sum(nn.layernorm_forward(np, x, w, b)[0] * ry)
    assert_close_grad(numgrad(f, x), dx, "dx")
    assert_close_grad(numgrad(f, w), dw, "dw")
    assert_close_grad(numgrad(f, b), db, "db")


def test_layernorm_accumulates():
    r = rng(9)
    x, w, b = r.standard_normal((B, T, C)), r.standard_normal(C), r.standard_normal(C)
    dy = r.standard_normal((B, T, C))
    _, cache = nn.layernorm_forward(np, x, w, b)
    gw, gb = np.zeros(C), np.zeros(C)
    dx0 = nn.layernorm_backward(np, dy, cache, w, gw, gb)
    pw, pb = r.standard_normal(C), r.standard_normal(C)
    dw, db = pw.copy(), pb.copy()
    nn.layernorm_backward(np, dy, cache, w, dw, db)
    dx1 = nn.layernorm_backward(np, dy, cache, w, dw, db)
    np.testing.assert_allclose(dw, pw + 2 * gw, rtol=1e-12)
    np.testing.assert_allclose(db, pb + 2 * gb, rtol=1e-12)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-12)  # backward must not mutate its cache


# ------------------------------------------------------------ activation

def test_gelu_fd_and_values():
    r = rng(10)
    x = r.standard_normal((B, T, C)) * 2
    ry = r.standard_normal((B, T, C))
    y, cache = nn.gelu_forward(np, x)
    k = math.sqrt(2 / math.pi)
    np.testing.assert_allclose(y, 0.5 * x * (1 + np.tanh(k * (x + 0.044715 * x**3))),
                               rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(nn.gelu_forward(np, np.array([1.0]))[0], [0.8411919906], rtol=1e-9)
    dx = nn.gelu_backward(np, ry, cache)
    f = lambda: np.sum(nn.gelu_forward(np, x)[0] * ry)
    assert_close_grad(numgrad(f, x), dx, "gelu dx")


def test_relu_fd_and_values():
    r = rng(11)
    x = r.standard_normal((B, T, C))
    x[np.abs(x) < 0.05] = 0.3  # stay away from the kink for finite differences
    ry = r.standard_normal((B, T, C))
    y, cache = nn.relu_forward(np, x)
    np.testing.assert_array_equal(y, np.where(x > 0, x, 0.0))
    dx = nn.relu_backward(np, ry, cache)
    f = lambda: np.sum(nn.relu_forward(np, x)[0] * ry)
    assert_close_grad(numgrad(f, x), dx, "relu dx")


# ------------------------------------------------------------- attention

def naive_attention(qkv, n_heads):
    """Loop reference: explicit head-major split, per-(b, h, t) causal softmax."""
    Bq, Tq, C3 = qkv.shape
    hd = C3 // (3 * n_heads)
    q5 = qkv.reshape(Bq, Tq, n_heads, 3, hd)
    y = np.zeros((Bq, Tq, n_heads, hd))
    for b in range(Bq):
        for h in range(n_heads):
            q, k, v = q5[b, :, h, 0], q5[b, :, h, 1], q5[b, :, h, 2]
            for t in range(Tq):
                s = k[: t + 1] @ q[t] / math.sqrt(hd)
                p = np.exp(s - s.max())
                y[b, t, h] = (p / p.sum()) @ v[: t + 1]
    return y.reshape(Bq, Tq, n_heads * hd)


def test_attention_matches_naive_reference():
    qkv = rng(12).standard_normal((B, T, 3 * C))
    y, _ = nn.attention_forward(np, qkv, H)
    np.testing.assert_allclose(y, naive_attention(qkv, H), rtol=1e-12, atol=1e-12)


def test_attention_fd():
    r = rng(13)
    qkv = r.standard_normal((B, T, 3 * C))
    ry = r.standard_normal((B, T, C))
    _, cache = nn.attention_forward(np, qkv, H)
    dqkv = nn.attention_backward(np, ry, cache)
    f = lambda: np.sum(nn.attention_forward(np, qkv, H)[0] * ry)
    assert_close_grad(numgrad(f, qkv), dqkv, "dqkv")


def test_attention_head_major_layout():
    r = rng(14)
    qkv = r.standard_normal((B, T, 3 * C))
    dy = r.standard_normal((B, T, C))
    y, cache = nn.attention_forward(np, qkv, H)
    dqkv = nn.attention_backward(np, dy, cache)
    hd = C // H
    for h in range(H):
        sl_in, sl_out = slice(h * 3 * hd, (h + 1) * 3 * hd), slice(h * hd, (h + 1) * hd)
        yh, ch = nn.attention_forward(np, qkv[..., sl_in], 1)
        np.testing.assert_allclose(y[..., sl_out], yh, rtol=1e-12, atol=1e-12)
        dh = nn.attention_backward(np, dy[..., sl_out], ch)
        np.testing.assert_allclose(dqkv[..., sl_in], dh, rtol=1e-12, atol=1e-12)


def test_attention_causal():
    r = rng(15)
    qkv = r.standard_normal((B, T, 3 * C))
    t0 = 2
    qkv2 = qkv.copy()
    qkv2[:, t0:] = r.standard_normal(qkv2[:, t0:].shape)
    y1, _ = nn.attention_forward(np, qkv, H)
    y2, _ = nn.attention_forward(np, qkv2, H)
    np.testing.assert_allclose(y1[:, :t0], y2[:, :t0], rtol=1e-13, atol=1e-13)
    assert not np.allclose(y1[:, t0:], y2[:, t0:])
    # and the gradient flows nowhere into the past from a future-only dy
    dy = np.zeros((B, T, C))
    dy[:, :t0] = 1.0
    _, cache = nn.attention_forward(np, qkv, H)
    dq = nn.attention_backward(np, dy, cache)
    np.testing.assert_array_equal(dq[:, t0:], 0.0)


# ------------------------------------------------------------------ loss

def naive_ce(logits, targets):
    lse = np.log(np.exp(logits).sum(-1))
    return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def test_cross_entropy_value_and_fd():
    r = rng(16)
    logits = r.standard_normal((B, T, V)) * 3
    targets = r.integers(0, V, (B, T))
    loss, cache = nn.cross_entropy_forward(np, logits, targets, B * T)
    np.testing.assert_allclose(loss, naive_ce(logits, targets).mean(), rtol=1e-12)
    dl = nn.cross_entropy_backward(np, cache, 0.7)
    f = lambda: 0.7 * float(nn.cross_entropy_forward(np, logits, targets, B * T)[0])
    assert_close_grad(numgrad(f, logits), dl, "dlogits")


def test_cross_entropy_stable_for_large_logits():
    logits = np.zeros((1, 2, 3))
    logits[0, 0] = [1000.0, 0.0, -1000.0]
    logits[0, 1] = [-1e4, -1e4, -1e4 + 1]
    loss, cache = nn.cross_entropy_forward(np, logits, np.array([[0, 2]]), 2)
    expect = (0.0 + (np.log(2 + np.e) - 1.0)) / 2
    np.testing.assert_allclose(loss, expect, rtol=1e-12, atol=1e-300)
    assert np.isfinite(nn.cross_entropy_backward(np, cache)).all()


def test_cross_entropy_global_norm():
    r = rng(17)
    logits = r.standard_normal((B, T, V))
    targets = r.integers(0, V, (B, T))
    n = B * T
    loss1, c1 = nn.cross_entropy_forward(np, logits, targets, n)
    loss4, c4 = nn.cross_entropy_forward(np, logits, targets, 4 * n)
    np.testing.assert_allclose(loss4, loss1 / 4, rtol=1e-12)
    np.testing.assert_allclose(nn.cross_entropy_backward(np, c4),
                               nn.cross_entropy_backward(np, c1) / 4, rtol=1e-12, atol=1e-15)
    # two halves of the batch, each normalised by the global count, sum to the whole
    parts = [nn.cross_entropy_forward(np, logits[i:i + 1], targets[i:i + 1], n) for i in range(B)]
    np.testing.assert_allclose(sum(float(p[0]) for p in parts), loss1, rtol=1e-12)
    d_parts = np.concatenate([nn.cross_entropy_backward(np, p[1]) for p in parts])
    np.testing.assert_allclose(d_parts, nn.cross_entropy_backward(np, c1), rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------- dtype

def test_float32_preserved_everywhere():
    r = rng(18)
    f32 = np.float32
    x = r.standard_normal((B, T, C)).astype(f32)
    dy = r.standard_normal((B, T, C)).astype(f32)
    wc = r.standard_normal((C, C)).astype(f32)
    vec = r.standard_normal(C).astype(f32)

    def check(*arrays):
        for a in arrays:
            assert np.asarray(a).dtype == f32, np.asarray(a).dtype

    y, c = nn.linear_forward(np, x, wc, vec)
    dw, db = strict_zeros((C, C), f32), strict_zeros(C, f32)
    check(y, nn.linear_backward(np, dy, c, wc, dw, db), dw, db)

    idx = r.integers(0, V, (B, T))
    we = r.standard_normal((V, C)).astype(f32)
    for start in (0, 4):
        y, c = nn.embedding_forward(np, idx, we, vocab_start=start)
        dw = strict_zeros((V, C), f32)
        nn.embedding_backward(np, dy, c, dw)
        check(y, dw)

    y, c = nn.layernorm_forward(np, x, vec, vec)
    dw, db = strict_zeros(C, f32), strict_zeros(C, f32)
    check(y, nn.layernorm_backward(np, dy, c, vec, dw, db), dw, db)

    for fwd, bwd in [(nn.gelu_forward, nn.gelu_backward), (nn.relu_forward, nn.relu_backward)]:
        y, c = fwd(np, x)
        check(y, bwd(np, dy, c))

    qkv = r.standard_normal((B, T, 3 * C)).astype(f32)
    y, c = nn.attention_forward(np, qkv, H)
    check(y, nn.attention_backward(np, dy, c))

    logits = r.standard_normal((B, T, V)).astype(f32)
    loss, c = nn.cross_entropy_forward(np, logits, idx, np.int64(4 * B * T))
    check(loss, nn.cross_entropy_backward(np, c, np.float64(2.0)))


def test_strict_grad_catches_upcast():
    g = strict_zeros(3, np.float32)
    with pytest.raises(AssertionError):
        g += np.ones(3)
