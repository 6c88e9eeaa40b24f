"""Routed experts of a Mixtral / Qwen3-MoE style layer: dropless, or with a capacity per expert and sequence.
The router (top-k selection, gates, aux and z balancing losses), capacity dropping, the dispatch permutation,
the grouped SwiGLU expert GEMMs and the combine, as separate steps so an all-to-all can go between them.
"""
import numpy as np

from hpengine.nn import fused, gemm
from hpengine.nn.activation import _no_overflow_warning
from hpengine.nn.linear import linear_backward_input, linear_backward_weight, linear_forward
from hpengine.nn.numerics import OFF
from hpengine.nn.swiglu import swiglu_backward, swiglu_forward, swiglu_recompute

# Router: logits l = x @ w_r (N, E); scores p = softmax(l) or sigmoid(l); each token picks the k experts
# with the largest p + bias (the bias only selects: it is in neither the gates nor any gradient) and gets
# gates p[n, idx[n]], divided by their sum when norm_topk. Experts: expert e computes
# y = (silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e] on the tokens that chose it, and the layer's output is
# the gate-weighted sum over a token's k choices. Balancing losses, without their coefficients:
# - aux (Switch / GShard), per sequence b of T = seq_len tokens: f_{b,i} = the share of the sequence's T k
#   selections that chose expert i (a constant), P_{b,i} = the mean over its tokens of p[:, i];
#   aux_b = E sum_i f_{b,i} P_{b,i} (1 under perfectly uniform routing). A call returns its share
#   T / norm * sum_b aux_b, so summing every rank's share gives the mean over the global batch's sequences,
#   and d aux / d p[n, i] = E f_{b(n),i} / norm.
# - z (router z-loss): sum over tokens of logsumexp(l)^2 / norm; d z / d l = 2 logsumexp(l) softmax(l) / norm.
# Group-limited routing (DeepSeek-V3): the E experts form n_groups equal groups of consecutive indices; a
# group's score is the sum of its two largest p + bias, and a token picks its k experts only within its
# topk_groups best groups (ties to the lower group index). routed_scaling multiplies the final gates, hence the
# routed experts' combined output. Both only select or scale: the gradient still flows through the gates alone.
SCORES = ("softmax", "sigmoid")


# The router computes in float32 when the activations are narrower (its softmax and top-k are sensitive to
# rounding) and never takes bf16 operands.
def _router_dtype(dtype):
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def _as(a, dtype):
    return a if a.dtype == dtype else a.astype(dtype)


def _scores(xp, logits, lse, score):
    # the same ops in forward and backward, so both see bit-identical probabilities
    if score == "softmax":
        return xp.exp(logits - lse[:, None])
    p = xp.negative(logits)
    with _no_overflow_warning(xp):      # exp overflows to inf for very negative logits: the sigmoid is then 0
        xp.exp(p, out=p)
    p += 1.0
    xp.reciprocal(p, out=p)
    return p


def _seq_fractions(xp, idx, seq_len, E, dtype, seq_sum=None):
    # f (B, E): the share of each sequence's seq_len * k selections that went to each expert; seq_sum, when a
    # rank holds only part of every sequence (context parallelism), sums the (B, E) counts over the parts
    N, k = idx.shape
    seq = xp.arange(N, dtype=np.int64) // seq_len
    cnt = xp.bincount((seq[:, None] * E + idx).reshape(-1), minlength=(N // seq_len) * E).reshape(-1, E)
    if seq_sum is None:
        return cnt.astype(dtype) / (seq_len * k)
    cnt = seq_sum(xp.ascontiguousarray(cnt, dtype=np.int64))
    return cnt.astype(dtype) / cnt.sum(axis=1, keepdims=True).astype(dtype)


def _stable_argsort(xp, a, axis=-1):
    # CuPy's sorts are always stable (older ones take no `kind`)
    if xp.__name__ == "cupy":
        return xp.argsort(a, axis=axis)
    return xp.argsort(a, axis=axis, kind="stable")


def _row_flat(xp, idx, E):
    # flat indices into a contiguous (N, E) array of the entries idx selects
    return (xp.arange(idx.shape[0], dtype=np.int64)[:, None] * E + idx).reshape(-1)


def _limit_to_groups(xp, sel, n_groups, topk_groups):
    # sel: (N, E) selection scores -> the same with every expert outside the token's topk_groups best groups
    # at -inf; a group of one expert scores that expert's score
    N, E = sel.shape
    per = E // n_groups
    top = xp.sort(sel.reshape(N, n_groups, per), axis=2)[:, :, -2:].sum(axis=2)
    best = _stable_argsort(xp, -top, axis=1)[:, :topk_groups]
    keep = xp.zeros((N, n_groups), dtype=bool)
    keep[xp.arange(N)[:, None], best] = True
    return xp.where(xp.repeat(keep, per, axis=1), sel, -xp.inf)


def _check_groups(k, E, n_groups, topk_groups, scale):
    if n_groups < 1 or E % n_groups:
        raise ValueError(f"n_groups {n_groups} must divide the {E} experts")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"topk_groups {topk_groups} must be in [1, {n_groups}] groups")
    if k > topk_groups * (E // n_groups):
        raise ValueError(f"top-k {k} is more than the {topk_groups * (E // n_groups)} experts of "
                         f"{topk_groups} groups of {E // n_groups}")
    if not scale > 0:
        raise ValueError(f"routed scaling {scale} must be > 0")


def router_forward(xp, x2, w, k, seq_len, norm, score="softmax", norm_topk=True, bias=None, seq_sum=None,
                   n_groups=1, topk_groups=1, scale=1.0):
    # x2: (N, C), w: (C, E), bias: (E,) or None -> idx (N, k) int64, gates (N, k), (aux, z), load (E,) int64
    N, E = x2.shape[0], w.shape[1]
    if score not in SCORES:
        raise ValueError(f"router score must be one of {SCORES}, got {score!r}")
    if not 1 <= k <= E:
        raise ValueError(f"top-k {k} must be in [1, {E}] experts")
    _check_groups(k, E, n_groups, topk_groups, scale)
    if seq_len < 1 or N % seq_len:
        raise ValueError(f"{N} tokens are not whole sequences of {seq_len}")
    ct = _router_dtype(x2.dtype)
    logits = _as(x2, ct) @ _as(w, ct)
    m = logits.max(axis=1, keepdims=True)
    lse = xp.exp(logits - m).sum(axis=1, keepdims=True)
    xp.log(lse, out=lse)
    lse += m
    lse = lse.reshape(-1)
    probs = _scores(xp, logits, lse, score)
    sel = probs if bias is None else probs + _as(bias, ct)
    if topk_groups < n_groups:
        sel = _limit_to_groups(xp, sel, n_groups, topk_groups)
    # a stable sort of the negated score keeps the lower expert first among exact ties
    idx = xp.ascontiguousarray(_stable_argsort(xp, -sel, axis=1)[:, :k]).astype(np.int64, copy=False)
    gates = probs.reshape(-1)[_row_flat(xp, idx, E)].reshape(N, k)
    if norm_topk:
        gates /= gates.sum(axis=1, keepdims=True)
    if scale != 1.0:
        gates *= scale
    f = _seq_fractions(xp, idx, seq_len, E, ct, seq_sum)
    aux = E * float((f * probs.reshape(-1, seq_len, E).sum(axis=1)).sum()) / norm
    z = float((lse * lse).sum()) / norm
    load = xp.bincount(idx.reshape(-1), minlength=E).astype(np.int64, copy=False)
    # probabilities are rebuilt from the logits in backward; gates from the probabilities and idx
    cache = (x2, logits, lse, idx, (k, seq_len, norm, score, bool(norm_topk), scale))
    return idx, _as(gates, x2.dtype), (aux, z), load, cache


def router_backward(xp, dgates, cache, w, dw, aux_coef=0.0, z_coef=0.0, dloss=1.0, seq_sum=None):
    # dgates: (N, k), w, dw: (C, E) -> dx2: (N, C); dloss scales the aux and z terms, not dgates
    x2, logits, lse, idx, (k, seq_len, norm, score, norm_topk, scale) = cache
    ct = logits.dtype
    N, E = logits.shape
    probs = _scores(xp, logits, lse, score)
    flat = _row_flat(xp, idx, E)
    dg = _as(dgates, ct)
    if scale != 1.0:
        dg = dg * scale
    if norm_topk:
        # g = p_sel / s: dp_sel = (dg - sum(dg * g)) / s
        p_sel = probs.reshape(-1)[flat].reshape(N, k)
        s = p_sel.sum(axis=1, keepdims=True)
        p_sel /= s
        dg = dg - (dg * p_sel).sum(axis=1, keepdims=True)
        dg /= s
    dprobs = xp.zeros((N, E), ct)
    dprobs.reshape(-1)[flat] = dg.reshape(-1)        # a token's k experts are distinct
    if aux_coef:
        f = _seq_fractions(xp, idx, seq_len, E, ct, seq_sum)
        dprobs.reshape(-1, seq_len, E)[...] += (aux_coef * dloss * E / norm) * f[:, None, :]
    if score == "softmax":
        dl = dprobs - (dprobs * probs).sum(axis=1, keepdims=True)
        dl *= probs
    else:
        dl = 1.0 - probs
        dl *= probs
        dl *= dprobs
    if z_coef:
        sm = probs if score == "softmax" else _scores(xp, logits, lse, "softmax")
        dl += (2.0 * z_coef * dloss / norm) * lse[:, None] * sm
    xa = _as(x2, ct)
    if dw.dtype == ct and fused.usable(xp, xa, dl, dw):
        gemm.matmul(xp, xa.T, dl, dw, accumulate=True)
    else:
        dw += _as(xa.T @ dl, dw.dtype)
    return _as(dl @ _as(w, ct).T, x2.dtype)


# Capacity (moe_capacity): within each sequence expert e keeps its first `capacity` (token, slot) assignments in
# the order (token position, then slot, the rank of e among the token's top_k); a later one is dropped: its
# idx becomes -1 and its gate 0 (after the top-k renormalisation, so the kept gates keep their values), and
# its row is never dispatched. Dropping depends only on idx, so it is piecewise constant like the selection.
def moe_capacity(xp, idx, gates, seq_len, E, capacity):
    # idx, gates: (N, k) from router_forward -> (idx with -1, gates with 0, for each dropped slot)
    N, k = idx.shape
    seq = xp.arange(N, dtype=np.int64) // seq_len
    key = (seq[:, None] * E + idx).reshape(-1)      # (sequence, expert) per slot, flat in (token, slot) order
    order = _stable_argsort(xp, key)                # by (sequence, expert), then (token, slot)
    cnt = xp.bincount(key, minlength=(N // seq_len) * E)
    start = xp.cumsum(cnt) - cnt
    rank = xp.empty_like(key)                       # an assignment's place in its (sequence, expert) queue
    rank[order] = xp.arange(key.shape[0], dtype=np.int64) - start[key[order]]
    keep = (rank < capacity).reshape(N, k)
    return xp.where(keep, idx, -1), gates * keep


# Dispatch, expert GEMMs and combine are separate steps, so an all-to-all can go between them: moe_permute
# sorts the kept (token, slot) pairs by expert (stable: then by token, then by slot), the grouped SwiGLU runs
# one GEMM per expert and projection on each expert's consecutive rows, and the combine gathers each
# token's kept rows back through the inverse permutation. A token has at most one row per slot, so the
# backward's "scatter-add to tokens" is a gather of its rows slot by slot too: no atomics, a deterministic sum.
def moe_permute(xp, idx, E, dropping=False):
    # idx: (N, k), -1 for a dropped slot (only when dropping) -> order (S,) int64 into the flattened slots,
    # the S <= N k kept ones sorted by expert; counts (E,) int64
    flat = idx.reshape(-1)
    if not dropping:
        order = _stable_argsort(xp, flat).astype(np.int64, copy=False)
        counts = xp.bincount(flat, minlength=E).astype(np.int64, copy=False)
        return order, counts
    key = xp.where(flat < 0, E, flat)               # dropped slots sort last, into a bucket E that is cut off
    order = _stable_argsort(xp, key).astype(np.int64, copy=False)
    counts = xp.bincount(key, minlength=E + 1).astype(np.int64, copy=False)
    return order[:flat.shape[0] - int(counts[E])], counts[:E]


def _inverse(xp, order, slots):
    # inv[p] = the permuted row of flat slot p, -1 for a dropped slot
    inv = xp.empty(slots, dtype=order.dtype) if order.shape[0] == slots else xp.full(slots, -1, dtype=order.dtype)
    inv[order] = xp.arange(order.shape[0], dtype=order.dtype)
    return inv


def _slot_sum(xp, rows, order, N, k, gates=None):
    # rows: (S, C) in dispatch order -> (N, C): each token's rows (times their gates) summed in slot order
    inv = _inverse(xp, order, N * k).reshape(N, k)
    if order.shape[0] == N * k:          # dropless: every slot has its row
        out = rows[inv[:, 0]] if gates is None else rows[inv[:, 0]] * gates[:, :1]
        for s in range(1, k):
            out += rows[inv[:, s]] if gates is None else rows[inv[:, s]] * gates[:, s:s + 1]
        return out
    dtype = rows.dtype if gates is None else np.result_type(rows.dtype, gates.dtype)
    out = xp.zeros((N,) + tuple(rows.shape[1:]), dtype=dtype)
    for s in range(k):                   # a dropped slot adds nothing (not even a zero-weighted row)
        t = xp.flatnonzero(inv[:, s] >= 0)
        r = rows[inv[t, s]]
        if gates is not None:
            r *= gates[t, s:s + 1]
        out[t] += r                      # t has each token once: no atomics
    return out


def _sizes(counts, E, S):
    # the per-expert row counts on the host: the GEMM shapes depend on them
    sizes = tuple(int(c) for c in (counts.tolist() if hasattr(counts, "tolist") else counts))
    if len(sizes) != E or sum(sizes) != S or min(sizes, default=0) < 0:
        raise ValueError(f"counts {sizes} do not split {S} rows over {E} experts")
    return sizes


def grouped_swiglu_forward(xp, xs, counts, w_gate, w_up, w_down, num=OFF):
    # xs: (S, C) grouped by expert, counts: (E,), w_gate, w_up: (E, C, F), w_down: (E, F, C) -> ys: (S, C)
    # num (nn/numerics.py): the products' operands; every output here stays as computed (float32_out)
    num = num.float32_out
    S, C = xs.shape
    sizes = _sizes(counts, w_gate.shape[0], S)
    ys = xp.empty((S, C), dtype=xs.dtype)
    sw = []
    o = 0
    for e, c in enumerate(sizes):
        if c == 0:
            sw.append(None)
            continue
        x = xs[o:o + c]
        g, _ = linear_forward(xp, x, w_gate[e], num=num)
        u, _ = linear_forward(xp, x, w_up[e], num=num)
        a, swc = swiglu_forward(xp, g, u, num)
        ys[o:o + c] = linear_forward(xp, a, w_down[e], num=num)[0]
        sw.append(swc)       # a is rebuilt from g, u, sigmoid(g) in backward, as nn/swiglu.py does
        o += c
    return ys, (xs, sizes, sw)


def _grouped_backward(xp, dys, xs, sizes, sw, w_gate, w_up, w_down, dw_gate, dw_up, dw_down, num):
    num = num.float32_out
    dxs = xp.empty(xs.shape, dtype=xs.dtype)
    o = 0
    for e, c in enumerate(sizes):
        if c == 0:
            continue
        x, dy, lead = xs[o:o + c], dys[o:o + c], (c,)
        a = swiglu_recompute(xp, sw[e], num)
        linear_backward_weight(xp, dy, (a, lead), dw_down[e], num=num)
        del a
        dg, du = swiglu_backward(xp, linear_backward_input(xp, dy, (None, lead), w_down[e], num), sw[e], num)
        linear_backward_weight(xp, dg, (x, lead), dw_gate[e], num=num)
        linear_backward_weight(xp, du, (x, lead), dw_up[e], num=num)
        dx = linear_backward_input(xp, dg, (None, lead), w_gate[e], num)
        dx += linear_backward_input(xp, du, (None, lead), w_up[e], num)
        dxs[o:o + c] = dx
        o += c
    return dxs


def grouped_swiglu_backward(xp, dys, cache, w_gate, w_up, w_down, dw_gate, dw_up, dw_down, num=OFF):
    # dys: (S, C) -> dxs: (S, C); accumulates into dw_gate, dw_up (E, C, F) and dw_down (E, F, C)
    xs, sizes, sw = cache
    return _grouped_backward(xp, dys, xs, sizes, sw, w_gate, w_up, w_down, dw_gate, dw_up, dw_down, num)


def moe_combine_forward(xp, ys, order, gates, N):
    # ys: (S, C) permuted rows, order: (S,), gates: (N, k) -> y: (N, C)
    # one gather per slot, summed in slot order: deterministic, with an (N, C) temporary
    return _slot_sum(xp, ys, order, N, gates.shape[1], gates), (ys, order, gates)


def moe_combine_backward(xp, dy, cache):
    # dy: (N, C) -> dys: (S, C), dgates: (N, k) (0 for a dropped slot)
    ys, order, gates = cache
    N, k = gates.shape
    dys = dy[order // k]
    dt = np.result_type(dy.dtype, ys.dtype)
    dgates = xp.empty(N * k, dtype=dt) if order.shape[0] == N * k else xp.zeros(N * k, dtype=dt)
    dgates[order] = (dys * ys).sum(axis=1)           # order holds every kept slot once
    dys *= gates.reshape(-1)[order][:, None]
    return dys, dgates.reshape(N, k)


def experts_forward(xp, x2, idx, gates, w_gate, w_up, w_down, dropping=False, num=OFF):
    # x2: (N, C), idx, gates: (N, k) from router_forward (or moe_capacity: dropping) -> y: (N, C)
    N, k = idx.shape
    order, counts = moe_permute(xp, idx, w_gate.shape[0], dropping)
    ys, (_, sizes, sw) = grouped_swiglu_forward(xp, x2[order // k], counts, w_gate, w_up, w_down, num)
    y, ccache = moe_combine_forward(xp, ys, order, gates, N)
    # the permuted input (k copies of every token) is gathered again from x2 in backward, not kept:
    # the router keeps x2 anyway
    return y, (x2, sizes, sw, ccache)


def experts_backward(xp, dy, cache, w_gate, w_up, w_down, dw_gate, dw_up, dw_down, num=OFF):
    # dy: (N, C) -> dx2: (N, C), dgates: (N, k); accumulates the three weight gradients
    x2, sizes, sw, ccache = cache
    order = ccache[1]
    N, k = ccache[2].shape
    dys, dgates = moe_combine_backward(xp, dy, ccache)
    dxs = _grouped_backward(xp, dys, x2[order // k], sizes, sw, w_gate, w_up, w_down,
                            dw_gate, dw_up, dw_down, num)
    del dys
    return tokens_sum(xp, dxs, order, N, k), dgates


def tokens_sum(xp, rows, order, N, k):
    # rows: (S, C) in dispatch order -> (N, C): each token's rows summed, in slot order
    return _slot_sum(xp, rows, order, N, k)


def moe_cache_bytes(n_tokens: int, k: int, E: int, C: int, F: int, item: int) -> int:
    """Bytes the router and experts forwards cache together for n_tokens = N tokens of `item`-byte
    activations (router math in r = max(item, 4) bytes), with S = N k routed rows:

        N C item              x2 (kept once, shared by router and experts)
      + N (E + 1) r           router logits and logsumexp
      + 2 S * 8               idx and the dispatch order (int64)
      + S (3 F + C) item      per-expert gate and up projections, sigmoid(gate); expert outputs
      + S item                gates

    Bytes, not elements: the cache mixes int64, the router dtype and the activation dtype."""
    N, S, r = n_tokens, n_tokens * k, max(item, 4)
    return N * C * item + N * (E + 1) * r + 16 * S + S * (3 * F + C + 1) * item
