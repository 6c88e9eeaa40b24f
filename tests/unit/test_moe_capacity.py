"""Capacity and selection bias in the routed experts of hpengine.nn.moe (NumPy, float64): which (token, slot)
assignments moe_capacity drops, against a per-sequence loop written here and hand-written cases; dispatch,
combine and the experts without the dropped rows; the router's and experts' backward with drops and with a
bias that changes the selection, against central differences (inputs with a selection margin far above the
difference step: selection and dropping are piecewise constant).
"""
import numpy as np
import pytest
from test_layers import numgrad
from test_moe_layers import (
    assert_close_grad,
    distinct_choices,
    expert_weights,
    naive_expert,
    naive_router,
    rng,
    selection_margin,
)

from hpengine.layout.cache import cache_nbytes
from hpengine.nn.moe import (
    experts_backward,
    experts_forward,
    moe_cache_bytes,
    moe_capacity,
    moe_combine_backward,
    moe_combine_forward,
    moe_permute,
    router_backward,
    router_forward,
    tokens_sum,
)


def naive_keep(idx, seq_len, E, capacity):
    """Per sequence, walk the tokens in position order and each token's slots in rank order; an expert keeps
    an assignment while it has taken fewer than `capacity` of the sequence's."""
    keep = np.zeros(idx.shape, dtype=bool)
    for b in range(idx.shape[0] // seq_len):
        taken = [0] * E
        for t in range(b * seq_len, (b + 1) * seq_len):
            for s in range(idx.shape[1]):
                e = idx[t, s]
                keep[t, s] = taken[e] < capacity
                taken[e] += 1
    return keep


def test_capacity_by_hand():
    # sequence 0: expert 0 is chosen by tokens 0, 1 and 2 (its third assignment is token 2's slot 1): dropped;
    # sequence 1 starts afresh: expert 0 again takes two (tokens 3, 4), token 5's is dropped, expert 1 keeps both
    idx = np.array([[0, 1], [0, 2], [1, 0],
                    [0, 1], [0, 1], [0, 2]])
    gates = np.arange(1, 13, dtype=np.float64).reshape(6, 2) / 20
    kept, g = moe_capacity(np, idx, gates, 3, 3, 2)
    np.testing.assert_array_equal(kept, [[0, 1], [0, 2], [1, -1], [0, 1], [0, 1], [-1, 2]])
    want = gates.copy()
    want[2, 1] = want[5, 0] = 0.0
    np.testing.assert_array_equal(g, want)
    # capacity 1: only each expert's first assignment in each sequence
    kept, _ = moe_capacity(np, idx, gates, 3, 3, 1)
    np.testing.assert_array_equal(kept, [[0, 1], [-1, 2], [-1, -1], [0, 1], [-1, -1], [-1, 2]])
    # token position comes first, not the slot: token 0's second choice keeps its place before the first
    # choices of tokens 1 and 2 (a slot-first rule, GShard's, would drop token 0's instead)
    idx2 = np.array([[1, 0], [0, 2], [0, 1]])
    np.testing.assert_array_equal(moe_capacity(np, idx2, gates[:3], 3, 3, 2)[0], [[1, 0], [0, 2], [-1, 1]])
    # a capacity no expert can reach (a token holds an expert once: at most seq_len per sequence) drops nothing
    np.testing.assert_array_equal(moe_capacity(np, idx, gates, 3, 3, 3)[0], idx)


@pytest.mark.parametrize("seed,capacity", [(0, 1), (1, 2), (2, 3)])
def test_capacity_matches_loop(seed, capacity):
    r = rng(seed)
    N, seq_len, k, E = 24, 6, 2, 4
    idx = distinct_choices(r, N, k, E)
    gates = r.uniform(0.1, 1.0, (N, k))
    kept, g = moe_capacity(np, idx, gates, seq_len, E, capacity)
    keep = naive_keep(idx, seq_len, E, capacity)
    assert (~keep).any()
    np.testing.assert_array_equal(kept, np.where(keep, idx, -1))
    np.testing.assert_array_equal(g, np.where(keep, gates, 0.0))
    # no expert holds more than `capacity` assignments of a sequence
    for b in range(N // seq_len):
        rows = kept[b * seq_len:(b + 1) * seq_len]
        assert max(int((rows == e).sum()) for e in range(E)) <= capacity


def test_permute_without_dropped_slots():
    idx = np.array([[2, 0], [-1, 2], [0, -1]])
    order, counts = moe_permute(np, idx, 3, dropping=True)
    np.testing.assert_array_equal(order, [1, 4, 0, 3])         # expert 0: slots 1, 4; expert 2: slots 0, 3
    np.testing.assert_array_equal(counts, [2, 0, 2])
    # dropping with nothing dropped is the dropless dispatch
    full = distinct_choices(rng(3), 5, 2, 4)
    for a, b in zip(moe_permute(np, full, 4, dropping=True), moe_permute(np, full, 4)):
        np.testing.assert_array_equal(a, b)


def test_combine_and_tokens_sum_skip_dropped_slots():
    r = rng(4)
    N, k, E, C = 6, 3, 4, 5
    idx = distinct_choices(r, N, k, E)
    idx[1, 0] = idx[4, 2] = idx[4, 1] = -1
    order, _ = moe_permute(np, idx, E, dropping=True)
    S = order.shape[0]
    assert S == N * k - 3
    ys = r.standard_normal((S, C))
    gates = np.where(idx >= 0, r.uniform(0.1, 1.0, (N, k)), 0.0)
    y, cache = moe_combine_forward(np, ys, order, gates, N)
    want, sums = np.zeros((N, C)), np.zeros((N, C))
    for j, p in enumerate(order):          # row j is (token p // k, slot p % k)
        want[p // k] += gates[p // k, p % k] * ys[j]
        sums[p // k] += ys[j]
    np.testing.assert_allclose(y, want, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(tokens_sum(np, ys, order, N, k), sums, rtol=1e-13, atol=1e-15)
    ry = r.standard_normal((N, C))
    dys, dgates = moe_combine_backward(np, ry, cache)
    assert dgates[1, 0] == dgates[4, 2] == dgates[4, 1] == 0.0
    f = lambda: np.sum(moe_combine_forward(np, ys, order, gates, N)[0] * ry)
    assert_close_grad(numgrad(f, ys), dys, "combine dys")
    assert_close_grad(numgrad(f, gates) * (idx >= 0), dgates, "combine dgates")


def test_experts_compute_only_the_kept_rows():
    r = rng(5)
    N, k, E, C, F = 8, 2, 4, 5, 3
    x2 = r.standard_normal((N, C))
    idx = distinct_choices(r, N, k, E)
    gates = r.uniform(0.1, 1.0, (N, k))
    kept, g = moe_capacity(np, idx, gates, 4, E, 1)
    W = expert_weights(r, E, C, F)
    y, cache = experts_forward(np, x2, kept, g, *W, dropping=True)
    assert sum(cache[1]) == int((kept >= 0).sum()) < N * k                 # the GEMMs' rows: the kept ones
    want = np.zeros((N, C))
    for t in range(N):
        for s in range(k):
            if kept[t, s] >= 0:
                e = kept[t, s]
                want[t] += g[t, s] * naive_expert(x2[t], W[0][e], W[1][e], W[2][e])
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-14)
    ry = r.standard_normal((N, C))
    grads = [np.zeros_like(w) for w in W]
    dx2, dgates = experts_backward(np, ry, cache, *W, *grads)
    f = lambda: np.sum(experts_forward(np, x2, kept, g, *W, dropping=True)[0] * ry)
    assert_close_grad(numgrad(f, x2), dx2, "experts dx2")
    assert (dgates[kept < 0] == 0).all()
    for name, w, gw in zip(("gate", "up", "down"), W, grads):
        assert_close_grad(numgrad(f, w), gw, f"experts d{name}")
    assert cache_nbytes(cache, set()) < cache_nbytes(experts_forward(np, x2, idx, gates, *W)[1], set())


LAYER = {"N": 16, "seq_len": 8, "k": 2, "E": 4, "C": 5, "F": 3, "norm": 16}


def layer_inputs(seed):
    r = rng(seed)
    n, C, E, F = LAYER["N"], LAYER["C"], LAYER["E"], LAYER["F"]
    x2 = r.standard_normal((n, C))
    wr = r.standard_normal((C, E)) * 1.5
    wr[:, 0] += 0.8          # expert 0 popular: its queue overflows
    return x2, wr, expert_weights(r, E, C, F), r.standard_normal((n, C))


@pytest.mark.parametrize("score,norm_topk", [("softmax", True), ("sigmoid", False), ("softmax", False)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_layer_with_capacity_fd(score, norm_topk, with_bias):
    """Router -> capacity -> experts: the gradient reaches the router through the kept gates (and, with
    norm_topk, through the dropped slot's share of the renormalisation) and the balancing losses."""
    x2, wr, W, ry = layer_inputs(6)
    k, seq_len, E, norm, cap = LAYER["k"], LAYER["seq_len"], LAYER["E"], LAYER["norm"], 3
    bias = np.array([-0.3, 0.2, 0.0, 0.1]) if with_bias else None
    assert selection_margin(x2, wr, k, score, bias) > 1e-4
    if with_bias:       # the bias changes the selection
        assert (naive_router(x2, wr, k, seq_len, norm, score, norm_topk, bias)[0]
                != naive_router(x2, wr, k, seq_len, norm, score, norm_topk)[0]).any()
    ca, cz = 0.1, 0.01

    def route():
        idx, gates, (aux, z), _, rc = router_forward(np, x2, wr, k, seq_len, norm, score, norm_topk, bias)
        kept, g = moe_capacity(np, idx, gates, seq_len, E, cap)
        return kept, g, aux, z, rc

    def f():
        kept, g, aux, z, _ = route()
        return np.sum(experts_forward(np, x2, kept, g, *W, dropping=True)[0] * ry) + ca * aux + cz * z

    kept, g, _, _, rcache = route()
    assert (kept < 0).sum() >= 2
    _, ecache = experts_forward(np, x2, kept, g, *W, dropping=True)
    grads = [np.zeros_like(w) for w in W]
    dx_e, dgates = experts_backward(np, ry, ecache, *W, *grads)
    dwr = np.zeros_like(wr)
    dx2 = dx_e + router_backward(np, dgates, rcache, wr, dwr, aux_coef=ca, z_coef=cz)
    assert_close_grad(numgrad(f, x2), dx2, "layer dx2")
    assert_close_grad(numgrad(f, wr), dwr, "layer dw_router")
    for name, w, gw in zip(("gate", "up", "down"), W, grads):
        assert_close_grad(numgrad(f, w), gw, f"layer d{name}")


def test_dropped_cache_is_within_the_dropless_count():
    x2, wr, W, _ = layer_inputs(7)
    k, seq_len, E = LAYER["k"], LAYER["seq_len"], LAYER["E"]
    idx, gates, _, _, rcache = router_forward(np, x2, wr, k, seq_len, LAYER["norm"])
    kept, g = moe_capacity(np, idx, gates, seq_len, E, 2)
    _, ecache = experts_forward(np, x2, kept, g, *W, dropping=True)
    assert cache_nbytes((rcache, ecache), set()) < moe_cache_bytes(LAYER["N"], k, E, LAYER["C"], LAYER["F"], 8)
