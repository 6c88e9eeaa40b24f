"""Tests for the routed experts of hpengine.nn.moe: router, dispatch, grouped SwiGLU experts, combine (NumPy,
float64 unless noted).

Forwards are checked against per-token loops written here and hand-computed balancing losses; every backward
against central differences of sum(y * r) (plus the weighted balancing losses for the router), on inputs
whose top-k selection has a margin far above the difference step (selection is piecewise constant).
"""
import math

import numpy as np
import pytest

from hpengine.layout.cache import cache_nbytes
from hpengine.nn.moe import (
    experts_backward,
    experts_forward,
    grouped_swiglu_backward,
    grouped_swiglu_forward,
    moe_cache_bytes,
    moe_combine_backward,
    moe_combine_forward,
    moe_permute,
    router_backward,
    router_forward,
)
from test_layers import numgrad  # central differences (tests/unit/test_layers.py)

FD_TOL = 1e-6


def rng(seed=0):
    return np.random.default_rng(seed)


def assert_close_grad(num, ana, what):
    assert num.shape == ana.shape, (what, num.shape, ana.shape)
    err = np.linalg.norm(num - ana) / max(np.linalg.norm(num) + np.linalg.norm(ana), 1e-30)
    assert err < FD_TOL, f"{what}: relative error {err:.3e}"
    assert np.linalg.norm(num) > 1e-8, f"{what}: gradient is trivially zero"


# ----------------------------------------------------------------- oracles

def naive_router(x2, w, k, seq_len, norm, score, norm_topk, bias=None):
    """Per-token loop in float64: selection by (-(p + bias), expert index), per-sequence aux, z."""
    x2, w = np.asarray(x2, np.float64), np.asarray(w, np.float64)
    N, E = x2.shape[0], w.shape[1]
    bias = np.zeros(E) if bias is None else np.asarray(bias, np.float64)
    idx, gates, probs, lses = [], [], [], []
    for n in range(N):
        lg = [float(sum(x2[n, c] * w[c, e] for c in range(x2.shape[1]))) for e in range(E)]
        m = max(lg)
        lse = m + math.log(sum(math.exp(v - m) for v in lg))
        if score == "softmax":
            p = [math.exp(v - lse) for v in lg]
        else:
            p = [1 / (1 + math.exp(-v)) for v in lg]
        chosen = sorted(range(E), key=lambda e: (-(p[e] + bias[e]), e))[:k]
        g = [p[e] for e in chosen]
        if norm_topk:
            g = [v / sum(g) for v in g]
        idx.append(chosen)
        gates.append(g)
        probs.append(p)
        lses.append(lse)
    aux = 0.0
    for b in range(N // seq_len):
        rows = range(b * seq_len, (b + 1) * seq_len)
        f = [sum(idx[n].count(e) for n in rows) / (seq_len * k) for e in range(E)]
        P = [sum(probs[n][e] for n in rows) / seq_len for e in range(E)]
        aux += E * sum(fi * pi for fi, pi in zip(f, P))
    aux *= seq_len / norm
    z = sum(v * v for v in lses) / norm
    load = [sum(row.count(e) for row in idx) for e in range(E)]
    return np.array(idx), np.array(gates), aux, z, np.array(load)


def silu(v):
    return v / (1 + np.exp(-v))


def naive_expert(x, wg, wu, wd):
    return (silu(x @ wg) * (x @ wu)) @ wd


def selection_margin(x2, w, k, score, bias=None):
    """Smallest gap between a token's k-th and (k+1)-th selection score (inf when k = E)."""
    lg = np.asarray(x2, np.float64) @ np.asarray(w, np.float64)
    p = np.exp(lg - lg.max(1, keepdims=True))
    p = p / p.sum(1, keepdims=True) if score == "softmax" else 1 / (1 + np.exp(-lg))
    s = -np.sort(-(p + (0 if bias is None else bias)), axis=1)
    return np.inf if k == s.shape[1] else float((s[:, k - 1] - s[:, k]).min())


def distinct_choices(r, N, k, E, avoid=()):
    allowed = [e for e in range(E) if e not in avoid]
    return np.array([r.choice(allowed, size=k, replace=False) for _ in range(N)], dtype=np.int64)


def expert_weights(r, E, C, F, dtype=np.float64):
    return [(r.standard_normal(s) / math.sqrt(s[1])).astype(dtype) for s in ((E, C, F), (E, C, F), (E, F, C))]


# ------------------------------------------------------------------ router

ROUTER = dict(N=12, seq_len=4, C=5, E=6, k=2)


def router_inputs(seed, dtype=np.float64):
    r = rng(seed)
    x2 = r.standard_normal((ROUTER["N"], ROUTER["C"]))
    w = r.standard_normal((ROUTER["C"], ROUTER["E"]))
    return x2.astype(dtype), w.astype(dtype)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_router_matches_naive(score, norm_topk, with_bias):
    x2, w = router_inputs(1)
    k, seq_len, E, norm = ROUTER["k"], ROUTER["seq_len"], ROUTER["E"], 20
    bias = None
    if with_bias:       # puts expert 3 first for every token: probabilities are at most 1
        bias = np.zeros(E)
        bias[3] = 2.0
    idx, gates, (aux, z), load, _ = router_forward(np, x2, w, k, seq_len, norm, score, norm_topk, bias)
    ridx, rgates, raux, rz, rload = naive_router(x2, w, k, seq_len, norm, score, norm_topk, bias)
    assert idx.dtype == np.int64 and idx.shape == (12, k) and load.dtype == np.int64
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_allclose(gates, rgates, rtol=1e-12)
    np.testing.assert_array_equal(load, rload)
    assert load.sum() == 12 * k
    assert isinstance(aux, float) and isinstance(z, float)
    assert math.isclose(aux, raux, rel_tol=1e-12) and math.isclose(z, rz, rel_tol=1e-12)
    if with_bias:
        plain_idx = router_forward(np, x2, w, k, seq_len, norm, score, norm_topk)[0]
        assert (idx[:, 0] == 3).all() and not (plain_idx == 3).any(axis=1).all()   # selection changed
        # the gates are the unbiased scores of the chosen experts
        all_idx, all_p = naive_router(x2, w, E, seq_len, norm, score, False)[:2]
        p = np.zeros_like(all_p)
        np.put_along_axis(p, all_idx, all_p, axis=1)         # p by expert index
        sel = np.take_along_axis(p, idx, axis=1)
        want = sel / sel.sum(1, keepdims=True) if norm_topk else sel
        np.testing.assert_allclose(gates, want, rtol=1e-12)


def test_router_ties_pick_lower_index():
    eye = np.eye(5)     # w = I: the logits are x2's rows
    x2 = np.array([[0.0, 2.0, 1.0, 2.0, 0.5],
                   [1.0, 1.0, 1.0, 1.0, 1.0],
                   [3.0, -1.0, 3.0, 3.0, 0.0]])
    for score in ("softmax", "sigmoid"):
        idx = router_forward(np, x2, eye, 3, 1, 3, score)[0]
        np.testing.assert_array_equal(idx, [[1, 3, 2], [0, 1, 2], [0, 2, 3]])
        # uniform probabilities and a bias tying experts 1 and 3 exactly: 1 first, then 3, then 0
        bias = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
        idx_b, gates_b = router_forward(np, np.zeros((2, 5)), eye, 3, 1, 2, score, bias=bias)[:2]
        np.testing.assert_array_equal(idx_b, [[1, 3, 0], [1, 3, 0]])
        np.testing.assert_allclose(gates_b, 1 / 3, rtol=1e-15)
    idx = router_forward(np, np.zeros((4, 3)), np.zeros((3, 6)), 2, 2, 4)[0]   # all experts tie
    np.testing.assert_array_equal(idx, np.tile([0, 1], (4, 1)))


def test_aux_closed_forms():
    # uniform probabilities: aux_b = E sum_i f_i / E = 1 per sequence, whatever was selected
    _, _, (aux, z), _, _ = router_forward(np, np.zeros((6, 3)), np.zeros((3, 4)), 2, 3, 6)
    assert math.isclose(aux, 1.0, rel_tol=1e-14)
    assert math.isclose(z, (math.log(4)) ** 2, rel_tol=1e-14)      # lse of four zeros, mean over 6 tokens
    # each expert chosen equally often (f = 1/E): aux_b = sum_i P_i = 1
    x2 = np.eye(4) * 3 + rng(2).uniform(0, 0.5, (4, 4))
    idx, _, (aux, _), load, _ = router_forward(np, x2, np.eye(4), 1, 4, 4)
    np.testing.assert_array_equal(idx[:, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(load, [1, 1, 1, 1])
    assert math.isclose(aux, 1.0, rel_tol=1e-13)
    # by hand, E = 2, k = 1: sequence A p = (.75, .25), (.6, .4) -> f = (1, 0), P = (.675, .325), aux_A = 1.35;
    # sequence B p = (.2, .8), (.3, .7) -> f = (0, 1), P = (.25, .75), aux_B = 1.5
    p = np.array([[0.75, 0.25], [0.6, 0.4], [0.2, 0.8], [0.3, 0.7]])
    _, gates, (aux, z), _, _ = router_forward(np, np.log(p), np.eye(2), 1, 2, 4, norm_topk=False)
    np.testing.assert_allclose(gates[:, 0], [0.75, 0.6, 0.8, 0.7], rtol=1e-14)
    assert math.isclose(aux, 2 / 4 * (1.35 + 1.5), rel_tol=1e-13)
    assert abs(z) < 1e-28                                   # logsumexp(log p) = log 1
    # a global batch of 8 tokens (norm = 8): this call's share is half of that mean
    assert math.isclose(router_forward(np, np.log(p), np.eye(2), 1, 2, 8)[2][0], aux / 2, rel_tol=1e-14)
    # pooled as one sequence of 4 the routing is balanced (f = (.5, .5)): aux = 1, so per-sequence matters
    assert math.isclose(router_forward(np, np.log(p), np.eye(2), 1, 4, 4)[2][0], 1.0, rel_tol=1e-13)


def test_router_z_against_logsumexp():
    x2, w = router_inputs(3)
    lg = x2 @ w
    lse = np.log(np.exp(lg).sum(1))
    for score in ("softmax", "sigmoid"):
        z = router_forward(np, x2 * 1.0, w, 2, 4, 30, score)[2][1]
        assert math.isclose(z, float((lse ** 2).sum() / 30), rel_tol=1e-12)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_router_fd(score, norm_topk):
    x2, w = router_inputs(4)
    k, seq_len, norm, E = ROUTER["k"], ROUTER["seq_len"], 17, ROUTER["E"]
    bias = np.linspace(-0.05, 0.05, E)
    assert selection_margin(x2, w, k, score, bias) > 1e-4
    rg = rng(5).standard_normal((ROUTER["N"], k))
    ca, cz, dloss = 0.3, 0.2, 1.7

    def f():
        _, gates, (aux, z), _, _ = router_forward(np, x2, w, k, seq_len, norm, score, norm_topk, bias)
        return np.sum(gates * rg) + dloss * (ca * aux + cz * z)

    _, _, _, _, cache = router_forward(np, x2, w, k, seq_len, norm, score, norm_topk, bias)
    pre = rng(6).standard_normal(w.shape)
    dw = pre.copy()
    dx2 = router_backward(np, rg, cache, w, dw, aux_coef=ca, z_coef=cz, dloss=dloss)
    assert dx2.shape == x2.shape
    assert_close_grad(numgrad(f, x2), dx2, "router dx2")
    assert_close_grad(numgrad(f, w), dw - pre, "router dw")
    # the losses alone, and the gates alone, are each right (not just their sum)
    dw2 = np.zeros_like(w)
    dx_l = router_backward(np, np.zeros_like(rg), cache, w, dw2, aux_coef=ca, z_coef=cz, dloss=dloss)
    dx_g = router_backward(np, rg, cache, w, np.zeros_like(w))
    np.testing.assert_allclose(dx_l + dx_g, dx2, rtol=1e-10, atol=1e-13)
    assert np.abs(dx_l).max() > 1e-3 and np.abs(dx_g).max() > 1e-3


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_router_low_precision_math_in_float32(dtype):
    x2, w = router_inputs(7, dtype)
    idx, gates, (aux, z), load, cache = router_forward(np, x2, w, 2, 4, 12, "softmax")
    assert gates.dtype == dtype and cache[1].dtype == np.float32 and cache[2].dtype == np.float32
    np.testing.assert_array_equal(cache[1], x2.astype(np.float32) @ w.astype(np.float32))
    ridx, rgates, raux, rz, _ = naive_router(x2, w, 2, 4, 12, "softmax", True)
    assert selection_margin(x2, w, 2, "softmax") > 1e-3
    np.testing.assert_array_equal(idx, ridx)
    tol = 2e-6 if dtype == np.float32 else 1e-3           # float16: only the gates' final rounding
    np.testing.assert_allclose(gates, rgates, rtol=tol)
    assert math.isclose(aux, raux, rel_tol=1e-5) and math.isclose(z, rz, rel_tol=1e-5)
    rg = rng(8).standard_normal(gates.shape).astype(dtype)
    dw = np.zeros(w.shape, dtype)
    dx2 = router_backward(np, rg, cache, w, dw, aux_coef=0.1, z_coef=0.1)
    assert dx2.dtype == dtype and dw.dtype == dtype
    x64, w64 = x2.astype(np.float64), w.astype(np.float64)
    c64 = router_forward(np, x64, w64, 2, 4, 12, "softmax")[4]
    dw64 = np.zeros(w.shape)
    dx64 = router_backward(np, rg.astype(np.float64), c64, w64, dw64, aux_coef=0.1, z_coef=0.1)
    tol = 1e-5 if dtype == np.float32 else 2e-3
    assert np.linalg.norm(dx2 - dx64) / np.linalg.norm(dx64) < tol
    assert np.linalg.norm(dw - dw64) / np.linalg.norm(dw64) < tol


def test_router_rejects_bad_arguments():
    x2, w = router_inputs(9)
    with pytest.raises(ValueError):
        router_forward(np, x2, w, 2, 5, 12)            # 12 tokens are not sequences of 5
    with pytest.raises(ValueError):
        router_forward(np, x2, w, 7, 4, 12)            # k > E
    with pytest.raises(ValueError):
        router_forward(np, x2, w, 2, 4, 12, "relu")


# ---------------------------------------------------------------- dispatch

def test_permute_bookkeeping():
    r = rng(10)
    N, k, E = 9, 3, 6
    idx = distinct_choices(r, N, k, E, avoid=(2,))
    order, counts = moe_permute(np, idx, E)
    assert order.dtype == counts.dtype == np.int64 and order.shape == (N * k,) and counts.shape == (E,)
    want = sorted(range(N * k), key=lambda p: (idx[p // k, p % k], p // k, p % k))
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(counts, [int((idx == e).sum()) for e in range(E)])
    assert counts[2] == 0 and counts.sum() == N * k
    np.testing.assert_array_equal(np.sort(order), np.arange(N * k))
    # repeated experts in a row (not a router output, but the dispatch does not care) stay in slot order
    order, counts = moe_permute(np, np.array([[1, 1], [0, 1]]), 3)
    np.testing.assert_array_equal(order, [2, 0, 1, 3])
    np.testing.assert_array_equal(counts, [1, 3, 0])


# --------------------------------------------------------- grouped experts

@pytest.mark.parametrize("counts", [[3, 0, 2, 4], [0, 5, 0, 1], [2, 2, 2, 2]])
def test_grouped_swiglu_matches_naive_and_fd(counts):
    E, C, F = 4, 5, 3
    r = rng(11)
    S = sum(counts)
    xs = r.standard_normal((S, C))
    wg, wu, wd = expert_weights(r, E, C, F)
    counts = np.array(counts, dtype=np.int64)
    ys, cache = grouped_swiglu_forward(np, xs, counts, wg, wu, wd)
    experts = np.repeat(np.arange(E), counts)
    want = np.stack([naive_expert(xs[j], wg[e], wu[e], wd[e]) for j, e in enumerate(experts)])
    np.testing.assert_allclose(ys, want, rtol=1e-12, atol=1e-14)
    ry = r.standard_normal((S, C))
    pres = [r.standard_normal(a.shape) for a in (wg, wu, wd)]
    grads = [p.copy() for p in pres]
    dxs = grouped_swiglu_backward(np, ry, cache, wg, wu, wd, *grads)
    f = lambda: np.sum(grouped_swiglu_forward(np, xs, counts, wg, wu, wd)[0] * ry)
    assert_close_grad(numgrad(f, xs), dxs, "grouped dxs")
    for name, a, g, p in zip(("dw_gate", "dw_up", "dw_down"), (wg, wu, wd), grads, pres):
        assert_close_grad(numgrad(f, a), g - p, f"grouped {name}")
        for e in np.flatnonzero(counts == 0):      # an expert without tokens gets no gradient at all
            np.testing.assert_array_equal(g[e], p[e])
    grouped_swiglu_backward(np, ry, cache, wg, wu, wd, *grads)      # a second pass adds the same again
    for name, a, g, p in zip(("dw_gate", "dw_up", "dw_down"), (wg, wu, wd), grads, pres):
        np.testing.assert_allclose(g - p, 2 * (numgrad(f, a)), rtol=1e-6, atol=1e-9)


def test_grouped_swiglu_no_rows():
    wg, wu, wd = expert_weights(rng(12), 3, 4, 2)
    ys, cache = grouped_swiglu_forward(np, np.zeros((0, 4)), np.zeros(3, np.int64), wg, wu, wd)
    assert ys.shape == (0, 4)
    grads = [np.zeros_like(a) for a in (wg, wu, wd)]
    assert grouped_swiglu_backward(np, np.zeros((0, 4)), cache, wg, wu, wd, *grads).shape == (0, 4)
    assert not any(g.any() for g in grads)
    with pytest.raises(ValueError):
        grouped_swiglu_forward(np, np.zeros((3, 4)), np.array([1, 1, 0]), wg, wu, wd)   # 2 rows, not 3


# ----------------------------------------------------------------- combine

def test_combine_matches_naive_and_fd():
    r = rng(13)
    N, k, E, C = 6, 3, 5, 4
    idx = distinct_choices(r, N, k, E)
    order, _ = moe_permute(np, idx, E)
    ys = r.standard_normal((N * k, C))
    gates = r.uniform(0.1, 1.0, (N, k))
    y, cache = moe_combine_forward(np, ys, order, gates, N)
    want = np.zeros((N, C))
    for t in range(N):
        for s in range(k):
            j = int(np.flatnonzero(order == t * k + s)[0])     # the permuted row of (token t, slot s)
            want[t] += gates[t, s] * ys[j]
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-14)
    ry = r.standard_normal((N, C))
    dys, dgates = moe_combine_backward(np, ry, cache)
    f = lambda: np.sum(moe_combine_forward(np, ys, order, gates, N)[0] * ry)
    assert_close_grad(numgrad(f, ys), dys, "combine dys")
    assert_close_grad(numgrad(f, gates), dgates, "combine dgates")


# --------------------------------------------------------------- end to end

def naive_experts(x2, idx, gates, wg, wu, wd):
    y = np.zeros_like(x2)
    for t in range(x2.shape[0]):
        for s in range(idx.shape[1]):
            e = idx[t, s]
            y[t] += gates[t, s] * naive_expert(x2[t], wg[e], wu[e], wd[e])
    return y


def test_experts_end_to_end_fd():
    r = rng(14)
    N, k, E, C, F = 7, 2, 5, 4, 3
    x2 = r.standard_normal((N, C))
    idx = distinct_choices(r, N, k, E, avoid=(1,))        # expert 1 gets no tokens
    gates = r.uniform(0.1, 1.0, (N, k))
    wg, wu, wd = expert_weights(r, E, C, F)
    y, cache = experts_forward(np, x2, idx, gates, wg, wu, wd)
    np.testing.assert_allclose(y, naive_experts(x2, idx, gates, wg, wu, wd), rtol=1e-12, atol=1e-14)
    ry = r.standard_normal((N, C))
    pres = [r.standard_normal(a.shape) for a in (wg, wu, wd)]
    grads = [p.copy() for p in pres]
    dx2, dgates = experts_backward(np, ry, cache, wg, wu, wd, *grads)
    f = lambda: np.sum(experts_forward(np, x2, idx, gates, wg, wu, wd)[0] * ry)
    assert_close_grad(numgrad(f, x2), dx2, "experts dx2")
    assert_close_grad(numgrad(f, gates), dgates, "experts dgates")
    for name, a, g, p in zip(("dw_gate", "dw_up", "dw_down"), (wg, wu, wd), grads, pres):
        assert_close_grad(numgrad(f, a), g - p, f"experts {name}")
        np.testing.assert_array_equal(g[1], p[1])


def test_router_and_experts_layer_fd():
    """Router -> experts as a layer: x2 reaches the loss through the gates and through the experts."""
    r = rng(15)
    N, seq_len, k, E, C, F, norm = 8, 4, 2, 4, 5, 3, 8
    x2 = r.standard_normal((N, C))
    wr = r.standard_normal((C, E))
    wg, wu, wd = expert_weights(r, E, C, F)
    assert selection_margin(x2, wr, k, "softmax") > 1e-4
    ry = r.standard_normal((N, C))

    def f():
        idx, gates, (aux, z), _, _ = router_forward(np, x2, wr, k, seq_len, norm)
        return np.sum(experts_forward(np, x2, idx, gates, wg, wu, wd)[0] * ry) + 0.01 * aux + 0.001 * z

    idx, gates, _, _, rcache = router_forward(np, x2, wr, k, seq_len, norm)
    _, ecache = experts_forward(np, x2, idx, gates, wg, wu, wd)
    grads = [np.zeros_like(a) for a in (wg, wu, wd)]
    dx_e, dgates = experts_backward(np, ry, ecache, wg, wu, wd, *grads)
    dwr = np.zeros_like(wr)
    dx2 = dx_e + router_backward(np, dgates, rcache, wr, dwr, aux_coef=0.01, z_coef=0.001)
    assert_close_grad(numgrad(f, x2), dx2, "layer dx2")
    assert_close_grad(numgrad(f, wr), dwr, "layer dw_router")
    assert_close_grad(numgrad(f, wd), grads[2], "layer dw_down")


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("N,seq_len,k,E,C,F", [(8, 4, 2, 4, 6, 3), (6, 6, 1, 3, 4, 5), (5, 1, 4, 4, 3, 2)])
def test_moe_cache_bytes(dtype, N, seq_len, k, E, C, F):
    r = rng(16)
    x2 = r.standard_normal((N, C)).astype(dtype)
    wr = r.standard_normal((C, E)).astype(dtype)
    wg, wu, wd = expert_weights(r, E, C, F, dtype)
    idx, gates, _, _, rcache = router_forward(np, x2, wr, k, seq_len, N)
    y, ecache = experts_forward(np, x2, idx, gates, wg, wu, wd)
    assert y.dtype == dtype
    item = np.dtype(dtype).itemsize
    assert cache_nbytes((rcache, ecache), set()) == moe_cache_bytes(N, k, E, C, F, item)
