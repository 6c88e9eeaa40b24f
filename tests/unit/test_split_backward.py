"""Split backwards for zero-bubble pipelines: each weight-carrying layer's input half (B) and weight half (W),
in hpengine/nn and models/tp_layers.py, checked against finite differences (float64) and bit for bit against
the fused backward (float64, float32, and bf16 operands for the GEMMs), with and without bias, on 2-D and 3-D
inputs. The tp pieces run under LOCAL, and under the sequence-parallel parts on a one-rank communicator that
counts its collectives (B gathers no stashed input; W does)."""
import numpy as np
import pytest

from test_layers import assert_close_grad, numgrad  # central differences (tests/unit/test_layers.py)
from hpengine import nn
from hpengine.models import LOCAL, Context
from hpengine.models import tp_layers as tp
from hpengine.nn import OFF, Numerics
from hpengine.strategies.sequence_parallel import SequenceParallel, SequenceSplit

B, T, C, OC, V = 2, 5, 8, 6, 11
SHAPES = {"2d": (B * T,), "3d": (B, T)}          # leading dims of a layer's input
DTYPES = ["float64", "float32", "bf16"]          # bf16: float32 storage, the layers handed a bf16 policy


def rng(seed):
    return np.random.default_rng(seed)


def rand(r, *shape, dtype=np.float64):
    return r.standard_normal(shape).astype(dtype)


def storage(dtype):
    return np.float32 if dtype == "bf16" else np.dtype(dtype).type


def _num(dtype):
    """The precision policy the layers are handed: bfloat16 GEMM operands for "bf16"."""
    return Numerics(bf16=True) if dtype == "bf16" else OFF


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ---------------------------------------------------------------- linear

@pytest.mark.parametrize("lead", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_split_fd(lead, bias):
    r = rng(1)
    x, w = rand(r, *SHAPES[lead], C), rand(r, C, OC)
    b = rand(r, OC) if bias else None
    ry = rand(r, *SHAPES[lead], OC)
    _, cache = nn.linear_forward(np, x, w, b)
    dx = nn.linear_backward_input(np, ry, cache, w)
    assert same(dx, nn.linear_backward_input(np, ry, nn.linear_drop_input(cache), w))   # B reads no input
    dw, db = np.zeros_like(w), (np.zeros(OC) if bias else None)
    assert nn.linear_backward_weight(np, ry, cache, dw, db) is None
    f = lambda: np.sum(nn.linear_forward(np, x, w, b)[0] * ry)
    assert_close_grad(numgrad(f, x), dx, "dx")
    assert_close_grad(numgrad(f, w), dw, "dw")
    if bias:
        assert_close_grad(numgrad(f, b), db, "db")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_b_then_w_is_fused_bitwise(dtype, lead, bias):
    r, dt = rng(2), storage(dtype)
    x, w, dy = rand(r, *SHAPES[lead], C, dtype=dt), rand(r, C, OC, dtype=dt), rand(r, *SHAPES[lead], OC, dtype=dt)
    g0w, g0b = rand(r, C, OC, dtype=dt), rand(r, OC, dtype=dt)            # accumulated into, not overwritten
    num = _num(dtype)
    _, cache = nn.linear_forward(np, x, w, rand(r, OC, dtype=dt) if bias else None, num=num.float32_out)
    dy_before = dy.copy()
    outs = {}
    for how in ("split", "fused"):
        dw, db = g0w.copy(), (g0b.copy() if bias else None)
        if how == "split":
            dx = nn.linear_backward_input(np, dy, cache, w, num)
            assert same(dy, dy_before)                                  # B leaves W's dy as it was
            nn.linear_backward_weight(np, dy, cache, dw, db, num)
        else:
            dx = nn.linear_backward(np, dy, cache, w, dw, db, num)
        outs[how] = (dx, dw, db)
    for got, want in zip(outs["split"], outs["fused"]):
        assert (got is None and want is None) or same(got, want)
    dx, dw, _ = outs["split"]
    assert dx.shape == x.shape and dx.dtype == dt and dw.dtype == dt
    if dtype == "bf16":                                # the bf16 path ran: float32 operands give other bits
        assert not same(dx, nn.linear_backward_input(np, dy, cache, w))


# ----------------------------------------------------------------- norms

def _layernorm(r, x, dt):
    w, b = rand(r, C, dtype=dt), rand(r, C, dtype=dt)
    return (w, b), (lambda: nn.layernorm_forward(np, x, w, b)), nn.layernorm_backward, \
        nn.layernorm_backward_input, nn.layernorm_backward_weight


def _rmsnorm(r, x, dt):
    w = rand(r, C, dtype=dt)
    return (w,), (lambda: nn.rmsnorm_forward(np, x, w)), nn.rmsnorm_backward, \
        nn.rmsnorm_backward_input, nn.rmsnorm_backward_weight


NORMS = {"layernorm": _layernorm, "rmsnorm": _rmsnorm}


@pytest.mark.parametrize("lead", SHAPES)
@pytest.mark.parametrize("norm", NORMS)
def test_norm_split_fd_and_w_is_a_no_op(lead, norm):
    r = rng(3)
    x = rand(r, *SHAPES[lead], C) * 2 + 0.5
    params, forward, _, bwd_in, bwd_w = NORMS[norm](r, x, np.float64)
    ry = rand(r, *SHAPES[lead], C)
    _, cache = forward()
    grads = tuple(np.zeros(C) for _ in params)
    dx = bwd_in(np, ry, cache, params[0], *grads)
    took = tuple(g.copy() for g in grads)
    assert bwd_w(np, None, None, *grads) is None                         # reads nothing, adds nothing
    assert all(same(g, t) for g, t in zip(grads, took))
    f = lambda: np.sum(forward()[0] * ry)
    assert_close_grad(numgrad(f, x), dx, "dx")
    for p, g, what in zip(params, grads, ("dw", "db")):
        assert_close_grad(numgrad(f, p), g, what)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("lead", SHAPES)
@pytest.mark.parametrize("norm", NORMS)
def test_norm_b_then_w_is_fused_bitwise(dtype, lead, norm):
    r, dt = rng(4), np.dtype(dtype).type
    x, dy = rand(r, *SHAPES[lead], C, dtype=dt), rand(r, *SHAPES[lead], C, dtype=dt)
    params, forward, fused, bwd_in, bwd_w = NORMS[norm](r, x, dt)
    _, cache = forward()
    g0 = tuple(rand(r, C, dtype=dt) for _ in params)
    split, whole = tuple(g.copy() for g in g0), tuple(g.copy() for g in g0)
    dx = bwd_in(np, dy, cache, params[0], *split)
    bwd_w(np, dy, cache, *split)
    assert same(dx, fused(np, dy, cache, params[0], *whole))
    assert all(same(a, b) for a, b in zip(split, whole))


# ------------------------------------------------------------- embedding

@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("vocab_start", [0, 3])
def test_embedding_split_fd_and_fused_bitwise(dtype, vocab_start):
    r, dt = rng(5), np.dtype(dtype).type
    idx = r.integers(0, V, (B, T))
    idx[0, :3] = 4                                      # repeated ids sum
    w = rand(r, V - 4 if vocab_start else V, C, dtype=dt)
    dy = rand(r, B, T, C, dtype=dt)
    _, cache = nn.embedding_forward(np, idx, w, vocab_start)
    g0 = rand(r, *w.shape, dtype=dt)
    dw, whole = g0.copy(), g0.copy()
    assert nn.embedding_backward_input(np, dy, cache) is None
    assert nn.embedding_backward_weight(np, dy, cache, dw) is None
    nn.embedding_backward(np, dy, cache, whole)
    assert same(dw, whole)
    if dtype == "float64":
        f = lambda: np.sum(nn.embedding_forward(np, idx, w, vocab_start)[0] * dy)
        assert_close_grad(numgrad(f, w), dw - g0, "dw")


# ---------------------------------------------------------------- tp layers

class CountingComm:
    """A one-rank communicator for the sequence-parallel parts: its collectives copy, and it counts them."""
    rank, size = 0, 1

    def __init__(self):
        self.calls = []

    def allgather_axis1(self, send, recv):
        self.calls.append("allgather")
        recv[...] = send
        return recv

    def reduce_scatter(self, send, recv, op=None):
        self.calls.append("reduce_scatter")
        recv.reshape(-1)[...] = send.reshape(-1)
        return recv

    def allreduce_(self, arr, op=None):
        self.calls.append("allreduce")
        return arr


def sp_context(num=OFF):
    comm = CountingComm()
    return Context(SequenceParallel(comm, V), SequenceSplit(comm), LOCAL.attn, LOCAL.ep, num), comm


def _columns(r, dt, n, bias):
    ws = tuple(rand(r, C, OC + i, dtype=dt) for i in range(n))
    bs = tuple(rand(r, OC + i, dtype=dt) for i in range(n)) if bias else None
    return ws, bs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("where", ["local", "sp"])
def test_columns_b_then_w_is_fused_bitwise(dtype, n, bias, where):
    r, dt = rng(6), storage(dtype)
    ws, bs = _columns(r, dt, n, bias)
    x = rand(r, B, T, C, dtype=dt)
    dys = tuple(rand(r, B, T, w.shape[1], dtype=dt) for w in ws)
    g0w, g0b = tuple(rand(r, *w.shape, dtype=dt) for w in ws), tuple(rand(r, w.shape[1], dtype=dt) for w in ws)
    outs = {}
    num = _num(dtype)
    for how in ("split", "fused"):
        ctx, comm = (Context(LOCAL.tp, LOCAL.seq, LOCAL.attn, LOCAL.ep, num), None) if where == "local" \
            else sp_context(num)
        _, stash = tp.columns_forward(np, ctx, x, ws, bs)
        gws, gbs = tuple(g.copy() for g in g0w), (tuple(g.copy() for g in g0b) if bias else None)
        if how == "split":
            if n == 1:
                dx = tp.column_backward_input(np, ctx, dys[0], stash, ws[0])
            else:
                dx = tp.columns_backward_input(np, ctx, dys, stash, ws)
            if comm is not None:                   # B: the reduce-scatter of dx, and no gather of x
                assert comm.calls == ["allgather", "reduce_scatter"]    # (the forward's gather first)
            if n == 1:
                tp.column_backward_weight(np, ctx, dys[0], stash, gws[0], gbs and gbs[0])
            else:
                tp.columns_backward_weight(np, ctx, dys, stash, gws, gbs)
            if comm is not None:                   # W gathers the stashed piece of x
                assert comm.calls == ["allgather", "reduce_scatter", "allgather"]
        elif n == 1:
            dx = tp.column_backward(np, ctx, dys[0], stash, ws[0], gws[0], gbs and gbs[0])
        else:
            dx = tp.columns_backward(np, ctx, dys, stash, ws, gws, gbs)
        outs[how] = (dx,) + gws + (gbs or ())
    assert len(outs["split"]) == len(outs["fused"])
    assert all(same(a, b) for a, b in zip(outs["split"], outs["fused"]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("where", ["local", "sp"])
def test_row_b_then_w_is_fused_bitwise(dtype, bias, where):
    r, dt = rng(7), storage(dtype)
    x, w = rand(r, B, T, OC, dtype=dt), rand(r, OC, C, dtype=dt)
    dy = rand(r, B, T, C, dtype=dt)
    g0w, g0b = rand(r, OC, C, dtype=dt), rand(r, C, dtype=dt)
    outs = {}
    num = _num(dtype)
    for how in ("split", "fused"):
        ctx, comm = (Context(LOCAL.tp, LOCAL.seq, LOCAL.attn, LOCAL.ep, num), None) if where == "local" \
            else sp_context(num)
        _, cache = tp.row_forward(np, ctx, x, w, rand(rng(8), C, dtype=dt) if bias else None)
        gw, gb = g0w.copy(), (g0b.copy() if bias else None)
        dy_before = dy.copy()
        if how == "split":
            dx, dy_full = tp.row_backward_input(np, ctx, dy, nn.linear_drop_input(cache), w, gb)
            assert same(dy, dy_before) and same(dy_full, dy)
            tp.row_backward_weight(np, ctx, dy_full, cache, gw)
            if comm is not None:                   # the forward's reduce-scatter, B's gather of dy: W none
                assert comm.calls == ["reduce_scatter", "allgather"]
        else:
            dx = tp.row_backward(np, ctx, dy, cache, w, gw, gb)
        outs[how] = (dx, gw) + ((gb,) if bias else ())
    assert all(same(a, b) for a, b in zip(outs["split"], outs["fused"]))


def test_column_and_row_split_fd():
    """The tp halves under LOCAL against central differences: a column pair of two biased linears feeding a
    row linear with a bias, y = row(h0 * h1), every input and weight gradient from B and W halves only."""
    r = rng(9)
    x = rand(r, B, T, C)
    w0, w1, b0, b1 = rand(r, C, OC), rand(r, C, OC), rand(r, OC), rand(r, OC)
    wr, br = rand(r, OC, C), rand(r, C)
    ry = rand(r, B, T, C)

    def forward():
        (h0, h1), stash = tp.columns_forward(np, LOCAL, x, (w0, w1), (b0, b1))
        y, c_row = tp.row_forward(np, LOCAL, h0 * h1, wr, br)
        return y, (stash, h0, h1, c_row)

    _, (stash, h0, h1, c_row) = forward()
    g = {k: np.zeros_like(v) for k, v in dict(w0=w0, w1=w1, b0=b0, b1=b1, wr=wr, br=br).items()}
    da, dy_full = tp.row_backward_input(np, LOCAL, ry, c_row, wr, g["br"])
    dys = (da * h1, da * h0)
    dx = tp.columns_backward_input(np, LOCAL, dys, stash, (w0, w1))
    tp.row_backward_weight(np, LOCAL, dy_full, c_row, g["wr"])          # W halves later, in any order
    tp.columns_backward_weight(np, LOCAL, dys, stash, (g["w0"], g["w1"]), (g["b0"], g["b1"]))
    f = lambda: np.sum(forward()[0] * ry)
    assert_close_grad(numgrad(f, x), dx, "dx")
    for k, a in dict(w0=w0, w1=w1, b0=b0, b1=b1, wr=wr, br=br).items():
        assert_close_grad(numgrad(f, a), g[k], k)
