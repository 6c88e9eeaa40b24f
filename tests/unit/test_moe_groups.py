"""Group-limited routing and the routed scaling of hpengine.nn.moe (DeepSeek-V3), float64: a hand-worked routing
with written-out expert choices, a per-token loop as the oracle on random inputs, the router's and the whole
layer's backward against central differences (inputs whose group and expert choices keep a margin far above the
difference step), and the config's refusals.
"""
import math

import numpy as np
import pytest

from hpengine.config.load import ConfigError, load_config
from hpengine.models.hf_llama import export_refusal
from hpengine.nn.moe import experts_backward, experts_forward, router_backward, router_forward
from test_layers import numgrad  # central differences (tests/unit/test_layers.py)
from test_moe_layers import assert_close_grad, expert_weights


def logit(p):
    return np.log(np.asarray(p, np.float64) / (1 - np.asarray(p, np.float64)))


def naive_grouped(x2, w, k, score, norm_topk, bias, G, TG, scale):
    """Per-token loop: group scores, the TG best groups, the k best experts in them, the scaled gates; also the
    smallest gap a selection depends on (the TG-th against the next group, the k-th against the next expert)."""
    N, E = x2.shape[0], w.shape[1]
    per, idx, gates, gap = E // G, [], [], math.inf
    for n in range(N):
        lg = [float(sum(x2[n, c] * w[c, e] for c in range(x2.shape[1]))) for e in range(E)]
        if score == "softmax":
            m = max(lg)
            tot = sum(math.exp(v - m) for v in lg)
            p = [math.exp(v - m) / tot for v in lg]
        else:
            p = [1 / (1 + math.exp(-v)) for v in lg]
        s = [p[e] + bias[e] for e in range(E)]
        gs = [sum(sorted(s[g * per:(g + 1) * per])[-2:]) for g in range(G)]
        groups = sorted(range(G), key=lambda g: (-gs[g], g))
        allowed = [e for g in groups[:TG] for e in range(g * per, (g + 1) * per)]
        chosen = sorted(allowed, key=lambda e: (-s[e], e))
        if TG < G:
            gap = min(gap, gs[groups[TG - 1]] - gs[groups[TG]])
        if k < len(chosen):
            gap = min(gap, s[chosen[k - 1]] - s[chosen[k]])
        g = [p[e] for e in chosen[:k]]
        tot = sum(g) if norm_topk else 1.0
        idx.append(chosen[:k])
        gates.append([scale * v / tot for v in g])
    return np.array(idx), np.array(gates), gap


# ------------------------------------------------------------------ by hand

# two tokens, six sigmoid experts in three groups {0, 1}, {2, 3}, {4, 5}; expert 2 biased by 0.25
P_HAND = [[0.9, 0.1, 0.6, 0.55, 0.7, 0.65],
          [0.5, 0.45, 0.15, 0.1, 0.4, 0.3]]
BIAS = np.array([0.0, 0.0, 0.25, 0.0, 0.0, 0.0])


def hand(k=2, n_groups=3, topk_groups=2, bias=BIAS, scale=1.0, norm_topk=True):
    return router_forward(np, logit(P_HAND), np.eye(6), k, 1, 2, "sigmoid", norm_topk, bias,
                          n_groups=n_groups, topk_groups=topk_groups, scale=scale)[:2]


def test_hand_worked_group_routing():
    # token 0, biased scores (.9, .1, .85, .55, .7, .65): group sums 1.0, 1.4, 1.35 -> groups 1 and 2, although
    # expert 0 is the best single score; in them 2 (.85) and 4 (.7). Gates: the unbiased .6 and .7, renormalised,
    # times 2.5. Token 1, (.5, .45, .4, .1, .4, .3): sums .95, .5, .7 -> groups 0 and 2 -> experts 0 and 1.
    idx, gates = hand(scale=2.5)
    np.testing.assert_array_equal(idx, [[2, 4], [0, 1]])
    np.testing.assert_allclose(gates, [[2.5 * .6 / 1.3, 2.5 * .7 / 1.3], [2.5 * .5 / .95, 2.5 * .45 / .95]],
                               rtol=1e-13)
    # one group per token: token 0 keeps group 1 (1.4) -> experts 2, 3; token 1 group 0 -> 0, 1
    idx, gates = hand(topk_groups=1, norm_topk=False)
    np.testing.assert_array_equal(idx, [[2, 3], [0, 1]])
    np.testing.assert_allclose(gates, [[.6, .55], [.5, .45]], rtol=1e-13)
    # without the bias token 0's sums are 1.0, 1.15, 1.35 -> groups 1, 2 -> experts 4 (.7), 5 (.65)
    np.testing.assert_array_equal(hand(bias=None)[0], [[4, 5], [0, 1]])
    # no groups: token 0 takes expert 0 (.9), then 2 (.85); all three groups open is the same as none
    np.testing.assert_array_equal(hand(n_groups=1, topk_groups=1)[0], [[0, 2], [0, 1]])
    np.testing.assert_array_equal(hand(topk_groups=3)[0], [[0, 2], [0, 1]])
    # four experts, still within the two open groups: token 0 never reaches expert 0 (.9), outside them
    np.testing.assert_array_equal(hand(k=4)[0], [[2, 4, 5, 3], [0, 1, 4, 5]])


def test_group_ties_pick_the_lower_group():
    # all scores equal: every group ties, groups 0 and 1 open, experts 0..3 in index order
    idx = router_forward(np, np.zeros((3, 4)), np.zeros((4, 8)), 3, 1, 3, "sigmoid", n_groups=4, topk_groups=2)[0]
    np.testing.assert_array_equal(idx, np.tile([0, 1, 2], (3, 1)))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("G,TG,k", [(4, 2, 3), (4, 1, 2), (2, 1, 4), (8, 3, 2)])
def test_router_matches_per_token_loop(score, G, TG, k):
    r = np.random.default_rng(11)
    N, C, E = 24, 6, 16
    x2, w = r.standard_normal((N, C)), r.standard_normal((C, E))
    bias = r.uniform(-0.1, 0.1, E)
    idx, gates = router_forward(np, x2, w, k, 4, N, score, True, bias, n_groups=G, topk_groups=TG, scale=1.7)[:2]
    ridx, rgates, _ = naive_grouped(x2, w, k, score, True, bias, G, TG, 1.7)
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_allclose(gates, rgates, rtol=1e-12)
    # the groups change some token's choice (else this case tests nothing about them)
    assert (naive_grouped(x2, w, k, score, True, bias, 1, 1, 1.7)[0] != ridx).any()


def test_ungrouped_default_is_bit_identical():
    r = np.random.default_rng(3)
    x2, w = r.standard_normal((8, 5)), r.standard_normal((5, 6))
    plain = router_forward(np, x2, w, 2, 4, 8, "sigmoid", True, np.linspace(0, .1, 6))
    spelled = router_forward(np, x2, w, 2, 4, 8, "sigmoid", True, np.linspace(0, .1, 6), None, 1, 1, 1.0)
    for a, b in zip(plain[:2], spelled[:2]):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ backward

@pytest.mark.parametrize("score,norm_topk", [("sigmoid", True), ("sigmoid", False), ("softmax", True)])
def test_router_fd_with_groups_and_scaling(score, norm_topk):
    r = np.random.default_rng(21)
    N, C, E, k, G, TG, seq_len, norm = 12, 5, 8, 3, 4, 2, 4, 15
    x2, w = r.standard_normal((N, C)), r.standard_normal((C, E))
    bias = np.linspace(-0.05, 0.05, E)
    assert naive_grouped(x2, w, k, score, norm_topk, bias, G, TG, 1.0)[2] > 1e-4
    rg = r.standard_normal((N, k))
    ca, cz, dloss = 0.3, 0.2, 1.3

    def call():
        return router_forward(np, x2, w, k, seq_len, norm, score, norm_topk, bias, None, G, TG, 2.5)

    def f():
        _, gates, (aux, z), _, _ = call()
        return np.sum(gates * rg) + dloss * (ca * aux + cz * z)

    cache = call()[4]
    dw = np.zeros_like(w)
    dx2 = router_backward(np, rg, cache, w, dw, aux_coef=ca, z_coef=cz, dloss=dloss)
    assert_close_grad(numgrad(f, x2), dx2, "router dx2")
    assert_close_grad(numgrad(f, w), dw, "router dw")


def test_layer_fd_with_groups_and_scaling():
    """Router -> experts -> combine: the gradient reaches the router and the input through the scaled gates."""
    r = np.random.default_rng(31)
    N, C, E, F, k, G, TG, seq_len = 8, 6, 8, 5, 2, 4, 2, 4
    x2, wr = r.standard_normal((N, C)), r.standard_normal((C, E))
    W, ry = expert_weights(r, E, C, F), r.standard_normal((N, C))
    bias = np.linspace(0.04, -0.04, E)
    assert naive_grouped(x2, wr, k, "sigmoid", True, bias, G, TG, 1.0)[2] > 1e-4

    def route():
        return router_forward(np, x2, wr, k, seq_len, N, "sigmoid", True, bias, None, G, TG, 2.5)

    def f():
        idx, gates = route()[:2]
        return np.sum(experts_forward(np, x2, idx, gates, *W)[0] * ry)

    idx, gates, _, _, rcache = route()
    _, ecache = experts_forward(np, x2, idx, gates, *W)
    grads = [np.zeros_like(a) for a in W]
    dx_e, dgates = experts_backward(np, ry, ecache, *W, *grads)
    dwr = np.zeros_like(wr)
    dx2 = dx_e + router_backward(np, dgates, rcache, wr, dwr)
    assert_close_grad(numgrad(f, x2), dx2, "layer dx2")
    assert_close_grad(numgrad(f, wr), dwr, "layer dw_router")
    for name, a, ga in zip(("gate", "up", "down"), W, grads):
        assert_close_grad(numgrad(f, a), ga, f"layer d{name}")
    # the scaling multiplies the routed output: 2.5 x the unscaled layer's
    y1 = experts_forward(np, x2, *router_forward(np, x2, wr, k, seq_len, N, "sigmoid", True, bias, None, G, TG)[:2],
                         *W)[0]
    np.testing.assert_allclose(experts_forward(np, x2, idx, gates, *W)[0], 2.5 * y1, rtol=1e-13)


def test_router_refuses_bad_groups():
    x2, w = np.zeros((2, 3)), np.zeros((3, 8))
    for kw, msg in (({"n_groups": 3}, "n_groups 3 must divide the 8 experts"),
                    ({"n_groups": 4, "topk_groups": 5}, r"topk_groups 5 must be in \[1, 4\]"),
                    ({"n_groups": 4, "topk_groups": 1}, "top-k 3 is more than the 2 experts"),
                    ({"scale": 0.0}, "routed scaling 0.0 must be > 0")):
        with pytest.raises(ValueError, match=msg):
            router_forward(np, x2, w, 3, 1, 2, "sigmoid", **kw)


# ------------------------------------------------------------------ config

MOE = ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=24", "model.moe.num_experts=8",
       "model.moe.top_k=3", "model.moe.router=sigmoid"]


@pytest.mark.parametrize("keys,msg", [
    (["model.moe.n_groups=3"], "model.moe.n_groups = 3 does not divide model.moe.num_experts = 8: use a divisor of 8"),
    (["model.moe.n_groups=0"], "model.moe.n_groups = 0: must be >= 1"),
    (["model.moe.n_groups=4", "model.moe.topk_groups=5"],
     "model.moe.topk_groups = 5 is more than model.moe.n_groups = 4: use 1..4"),
    (["model.moe.topk_groups=0"], "model.moe.topk_groups = 0: must be >= 1"),
    (["model.moe.n_groups=4", "model.moe.topk_groups=1"],
     "model.moe.top_k = 3 is more than the 2 experts of model.moe.topk_groups = 1 groups of 2: use top_k 1..2"),
    (["model.moe.routed_scaling=0"], "model.moe.routed_scaling = 0.0: must be > 0"),
    (["model.moe.routed_scaling=-1.5"], "model.moe.routed_scaling = -1.5: must be > 0"),
])
def test_config_refuses_in_one_line(keys, msg):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*MOE, *keys])
    assert msg in str(err.value) and "\n" not in str(err.value)


def test_config_accepts_deepseek_routing():
    m = load_config(None, [*MOE, "model.moe.n_groups=4", "model.moe.topk_groups=2", "model.moe.routed_scaling=2.5"]).model
    assert (m.moe.n_groups, m.moe.topk_groups, m.moe.routed_scaling) == (4, 2, 2.5)


@pytest.mark.parametrize("keys,what", [(["model.moe.n_groups=4", "model.moe.topk_groups=2"], "topk_groups"),
                                       (["model.moe.routed_scaling=2.5"], "routed_scaling = 1")])
def test_mixtral_and_qwen3_exports_refuse_deepseek_routing(keys, what):
    base = [k for k in MOE if "router" not in k]
    for extra in ([], ["model.qk_norm=true"]):          # Mixtral, Qwen3-MoE
        mcfg = load_config(None, [*base, *extra, *keys]).model
        assert what in export_refusal(mcfg)
        assert export_refusal(load_config(None, [*base, *extra]).model) == ""
