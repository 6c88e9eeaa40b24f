"""The parallel context and the tensor-parallel layer pairs on one rank: every part of LOCAL is the identity,
and the column, row, embedding and loss pieces under it are their plain nn/ layers, checked bit for bit
against nn/ and to rounding against NumPy's own formulas (x @ w + b, x.T @ dy, dy @ w.T, w[idx])."""
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from hpengine import nn
from hpengine.dist.comm import Comm
from hpengine.models import LOCAL, Context, LocalTP
from hpengine.models.context import LocalAttn, LocalEP, LocalSeq, local_context
from hpengine.models.tp_layers import (column_backward, column_forward, columns_backward, columns_forward,
                                       row_backward, row_forward, vocab_embed_backward, vocab_embed_forward,
                                       vocab_loss_backward, vocab_loss_forward)
from hpengine.strategies.context import make_context
from hpengine.strategies.expert_parallel import ExpertParallel
from hpengine.strategies.sequence_parallel import SequenceParallel, SequenceSplit
from hpengine.strategies.tensor_parallel import TensorParallel, TensorParallelSeq

B, T, C, OC, V = 2, 6, 8, 12, 10


def rand(*shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def assert_rounded_alike(got, want, size, n):
    """got and want: two roundings, in their dtype, of the same sums of n terms, `size` the sums of the terms'
    sizes (|A| @ |B| for a GEMM). Any order of summation, with or without FMA, is within gamma_n * size of the
    exact sum (gamma_n = n u / (1 - n u), u = eps / 2), so the two are within 2 gamma_n * size of each other:
    judged against the operands, this holds on every BLAS kernel, where a relative tolerance fails on an element
    that cancels (a float32 GEMM on OpenBLAS's Haswell kernels: 0.000793 off by 1.2e-8)."""
    u = np.finfo(got.dtype).eps / 2
    bound = 2 * n * u / (1 - n * u) * size
    assert got.dtype == want.dtype and np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


def test_local_context_parts_are_identities():
    x, y = rand(B, T, C), rand(B, T, C, seed=1)
    assert local_context() is LOCAL and isinstance(LOCAL, Context)
    tp, seq = LOCAL.tp, LOCAL.seq
    assert (tp.rank, tp.size, seq.parts) == (0, 1, 1)
    for f in (tp.copy_to_tp, tp.copy_to_tp_backward, tp.reduce_from_tp, tp.reduce_from_tp_backward):
        assert f(x) is x
    assert seq.local_positions(T) == slice(0, T)
    caches = (("a", 1), ("b", 2))
    stash = seq.stash_inputs(x, *caches)
    assert stash == caches and seq.unstash_inputs(stash) == caches
    g = rand(20)
    before = g.copy()
    seq.sum_replicated_(g, [(0, 5), (10, 20)])
    assert np.array_equal(g, before)
    k, v = LOCAL.attn.kv_forward(x, y)
    assert k is x and v is y
    dk, dv = LOCAL.attn.kv_backward(y, x)
    assert dk is y and dv is x
    assert LOCAL.attn.kv_forward(x, None) == (x, None)


def test_ep_dispatch_and_combine_are_identities():
    ep, x = LOCAL.ep, rand(B * T, C)
    counts = np.bincount(np.arange(B * T) % 3, minlength=3)
    rows, local, plan = ep.dispatch(x, counts)
    assert rows is x and local is counts and (ep.rank, ep.size) == (0, 1)
    for f in (ep.dispatch_backward, ep.combine, ep.combine_backward):
        assert f(x, plan) is x


def test_local_tp_cross_entropy_is_nn():
    logits, t = rand(B, T, V), np.random.default_rng(2).integers(0, V, (B, T))
    loss, cache = LOCAL.tp.cross_entropy_forward(np, logits.copy(), t, B * T)
    want, wcache = nn.cross_entropy_forward(np, logits.copy(), t, B * T)
    assert loss == want
    assert np.array_equal(LOCAL.tp.cross_entropy_backward(np, cache, 2.0), nn.cross_entropy_backward(np, wcache, 2.0))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_column_pair_is_the_plain_linear(dtype, bias):
    x, w, dy = rand(B, T, C, dtype=dtype), rand(C, OC, seed=1, dtype=dtype), rand(B, T, OC, seed=2, dtype=dtype)
    b = rand(OC, seed=3, dtype=dtype) if bias else None
    y, stash = column_forward(np, LOCAL, x, w, b)
    y_nn, c_nn = nn.linear_forward(np, x, w, b)
    assert np.array_equal(y, y_nn)
    # against NumPy's formulas to rounding, judged against the operands' sizes (the bias: one term more)
    ax, aw, ady, x2, dy2 = abs(x), abs(w), abs(dy), x.reshape(-1, C), dy.reshape(-1, OC)
    assert_rounded_alike(y, x @ w + (b if bias else 0), ax @ aw + (abs(b) if bias else 0), C + int(bias))
    gw, gw_nn = np.zeros_like(w), np.zeros_like(w)
    gb, gb_nn = (np.zeros_like(b), np.zeros_like(b)) if bias else (None, None)
    dx = column_backward(np, LOCAL, dy, stash, w, gw, gb)
    dx_nn = nn.linear_backward(np, dy, c_nn, w, gw_nn, gb_nn)
    assert np.array_equal(dx, dx_nn) and np.array_equal(gw, gw_nn)
    assert_rounded_alike(dx, dy @ w.T, ady @ aw.T, OC)
    assert_rounded_alike(gw, x2.T @ dy2, abs(x2).T @ abs(dy2), B * T)
    if bias:
        assert np.array_equal(gb, gb_nn)
        assert_rounded_alike(gb, dy2.sum(axis=0), abs(dy2).sum(axis=0), B * T)


def test_columns_share_one_input_and_sum_their_input_gradients_in_order():
    x = rand(B, T, C)
    ws = (rand(C, OC, seed=1), rand(C, 4, seed=2), rand(C, 4, seed=3))     # q wide, k and v narrower (GQA)
    dys = tuple(rand(B, T, w.shape[1], seed=10 + i) for i, w in enumerate(ws))
    ys, stash = columns_forward(np, LOCAL, x, ws)
    caches = []
    for y, w in zip(ys, ws):
        y_nn, c = nn.linear_forward(np, x, w)
        assert np.array_equal(y, y_nn)
        caches.append(c)
    gws, gws_nn = [np.zeros_like(w) for w in ws], [np.zeros_like(w) for w in ws]
    dx = columns_backward(np, LOCAL, dys, stash, ws, gws)
    dx_nn = nn.linear_backward(np, dys[0], caches[0], ws[0], gws_nn[0])
    for i in (1, 2):
        dx_nn += nn.linear_backward(np, dys[i], caches[i], ws[i], gws_nn[i])
    assert np.array_equal(dx, dx_nn) and all(np.array_equal(a, b) for a, b in zip(gws, gws_nn))
    np.testing.assert_allclose(dx, sum(d @ w.T for d, w in zip(dys, ws)), rtol=1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_row_pair_is_the_plain_linear_with_the_bias_after(bias):
    x, w, dy = rand(B, T, OC), rand(OC, C, seed=1), rand(B, T, C, seed=2)
    b = rand(C, seed=3) if bias else None
    y, cache = row_forward(np, LOCAL, x, w, b)
    y_nn, c_nn = nn.linear_forward(np, x, w)
    if bias:
        y_nn += b
    assert np.array_equal(y, y_nn)
    np.testing.assert_allclose(y, x @ w + (b if bias else 0), rtol=1e-12)
    gw, gw_nn = np.zeros_like(w), np.zeros_like(w)
    gb = np.zeros_like(b) if bias else None
    dx = row_backward(np, LOCAL, dy, cache, w, gw, gb)
    assert np.array_equal(dx, nn.linear_backward(np, dy, c_nn, w, gw_nn)) and np.array_equal(gw, gw_nn)
    np.testing.assert_allclose(gw, x.reshape(-1, OC).T @ dy.reshape(-1, C), rtol=1e-12)
    if bias:
        np.testing.assert_allclose(gb, dy.reshape(-1, C).sum(axis=0), rtol=1e-12)


def test_vocab_embedding_pair_is_a_lookup_and_a_scatter():
    w, idx = rand(V, C), np.random.default_rng(4).integers(0, V, (B, T))
    e, cache = vocab_embed_forward(np, LOCAL, idx, w)
    assert np.array_equal(e, w[idx])
    dx, gw = rand(B, T, C, seed=5), np.zeros_like(w)
    vocab_embed_backward(np, LOCAL, dx, cache, gw)
    want = np.zeros_like(w)
    np.add.at(want, idx.reshape(-1), dx.reshape(-1, C))
    np.testing.assert_allclose(gw, want, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_vocab_loss_is_linear_then_cross_entropy(dtype):
    """Half-precision logits (amp) reach the loss as float32; the gradient returns in the weights' dtype."""
    h, w = rand(B, T, C, dtype=dtype), rand(C, V, seed=1, dtype=dtype)
    t = np.random.default_rng(6).integers(0, V, (B, T))
    loss, cache = vocab_loss_forward(np, LOCAL, h, w, t, B * T)
    logits, c_lin = nn.linear_forward(np, h, w)
    want, c_ce = nn.cross_entropy_forward(np, logits.astype(np.float32) if dtype == np.float16 else logits, t, B * T)
    assert loss == want
    z = (h.reshape(-1, C) @ w).astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    ref = (np.log(np.exp(z).sum(axis=1)) - z[np.arange(B * T), t.reshape(-1)]).mean()
    np.testing.assert_allclose(float(loss), ref, rtol=1e-3 if dtype == np.float16 else 1e-12)
    gw, gw_nn = np.zeros_like(w), np.zeros_like(w)
    dh = vocab_loss_backward(np, LOCAL, cache, w, gw, 4.0)
    dlogits = nn.cross_entropy_backward(np, c_ce, 4.0).astype(dtype)
    assert dh.dtype == dtype
    assert np.array_equal(dh, nn.linear_backward(np, dlogits, c_lin, w, gw_nn)) and np.array_equal(gw, gw_nn)


def _self_comm():
    return Comm(MPI.COMM_SELF, "tp")


def test_make_context_picks_the_parts_of_the_layout():
    comms = {"tp": _self_comm(), "ep": _self_comm()}
    assert make_context(SimpleNamespace(tp=1, sp=False, ep=1, cp=1), comms, V) is LOCAL
    tp = make_context(SimpleNamespace(tp=2, sp=False, ep=1, cp=1), comms, V)
    assert type(tp.tp) is TensorParallel and type(tp.seq) is TensorParallelSeq and tp.tp.comm is comms["tp"]
    assert isinstance(tp.seq, LocalSeq) and tp.seq.parts == 1 and tp.seq.comm is comms["tp"]
    ep = make_context(SimpleNamespace(tp=1, sp=False, ep=2, cp=1), comms, V, np)
    assert type(ep.ep) is ExpertParallel and ep.ep.comm is comms["ep"] and ep.tp is LOCAL.tp
    sp = make_context(SimpleNamespace(tp=2, sp=True, ep=1, cp=1), comms, V)
    assert type(sp.tp) is SequenceParallel and type(sp.seq) is SequenceSplit
    for ctx in (tp, sp):
        assert type(ctx.attn) is LocalAttn and type(ctx.ep) is LocalEP
        assert isinstance(ctx.tp, LocalTP)


def test_sequence_split_stashes_its_piece_and_restores_the_whole_input():
    """On a one-rank communicator the gathers copy: the column pair through the split seq part is the plain
    linear, with the stash holding x itself and no linear keeping its input."""
    comm = _self_comm()
    ctx = Context(SequenceParallel(comm, V), SequenceSplit(comm), LOCAL.attn, LOCAL.ep)
    assert ctx.seq.parts == 1 and ctx.seq.local_positions(T) == slice(0, T)
    x, w, dy = rand(B, T, C), rand(C, OC, seed=1), rand(B, T, OC, seed=2)
    y, stash = column_forward(np, ctx, x, w)
    assert stash[0] is x and stash[1][0] is None
    y_nn, c_nn = nn.linear_forward(np, x, w)
    assert np.array_equal(y, y_nn)
    gw, gw_nn = np.zeros_like(w), np.zeros_like(w)
    dx = column_backward(np, ctx, dy, stash, w, gw)
    assert np.array_equal(dx, nn.linear_backward(np, dy, c_nn, w, gw_nn)) and np.array_equal(gw, gw_nn)
