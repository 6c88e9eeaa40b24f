"""Context-parallel attention over MPI (cp = world size, 2 or 4): each rank holds its head-tail part of a
sequence, and the ring and the all-gather give, in float64, the one-process attention of the whole
sequence (nn/gqa.py, computed on every rank from the same seeded data) to 1e-12, forward and backward.

Bytes counted per rank, with Tk = T / cp tokens per rank per sequence, B sequences, K key/value heads
of head_dim hd, 8-byte elements:
  ring forward      send = recv = 2 B Tk K hd (cp - 1) elements (k and v), plus 8 Tk (cp - 1) bytes of
                    int64 positions
  ring backward     send = recv = 2 B Tk K hd (cp - 1) elements (k and v again) + 2 B Tk K hd cp (dk, dv,
                    the last step returning them to their owners); no positions
  all-gather        allgather = reduce_scatter = 2 B T K hd elements (every rank's k and v; dk and dv)
"""
import numpy as np
import pytest
from helpers import need

from hpengine.dist.comm import Comm
from hpengine.nn.context_split import (
    contiguous_positions,
    head_tail_positions,
    split_sequence,
)
from hpengine.nn.gqa import gqa_attention_backward, gqa_attention_forward
from hpengine.strategies.context_parallel import CONTEXT_ATTENTION

B, T, HD = 2, 16, 4


@pytest.fixture
def cp_comm(world):
    n = world.Get_size()
    need(n in (2, 4), "context parallelism over the world needs 2 or 4 ranks")
    c = world.Dup()
    yield Comm(c, "cp")
    c.Free()


def seeded(H, K):
    rng = np.random.default_rng(11)
    q, do = rng.standard_normal((B, T, H, HD)), rng.standard_normal((B, T, H, HD))
    k, v = rng.standard_normal((B, T, K, HD)), rng.standard_normal((B, T, K, HD))
    return q, k, v, do


def one_process(q, k, v, do):
    """o, dq, dk, dv (B, T, heads, hd) of the whole sequence through the library's plain attention."""
    H, scale = q.shape[2], 1.0 / np.sqrt(HD)
    heads = lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3))
    y, cache = gqa_attention_forward(np, heads(q) * scale, heads(k), heads(v))
    dq, dk, dv = gqa_attention_backward(np, do.reshape(B, T, H * HD), cache)
    tokens = lambda a: a.transpose(0, 2, 1, 3)
    return y.reshape(B, T, H, HD), tokens(dq) * scale, tokens(dk), tokens(dv)


def local(comm, how, q, k, v, do, pos):
    """This rank's o, dq, dk, dv (B, Tk, heads, hd) and the counters of each pass."""
    fwd, bwd = CONTEXT_ATTENTION[how]
    if pos is None:
        part = lambda a: split_sequence(np, a, comm.size, comm.rank).transpose(0, 2, 1, 3)
        pos = head_tail_positions(T, comm.size, comm.rank)
    else:
        part = lambda a: a[:, pos].transpose(0, 2, 1, 3)
    comm.reset_stats()
    o, cache = fwd(np, comm, part(q), part(k), part(v), pos, pos)
    f = {op: list(s) for op, s in comm.stats.items()}
    comm.reset_stats()
    grads = bwd(np, comm, part(do), cache)
    b = {op: list(s) for op, s in comm.stats.items()}
    return [a.transpose(0, 2, 1, 3) for a in (o, *grads)], pos, f, b


@pytest.mark.parametrize("how", list(CONTEXT_ATTENTION))
@pytest.mark.parametrize("H,K", [(2, 2), (4, 2), (4, 1)])
def test_equals_one_process(cp_comm, how, H, K):
    q, k, v, do = seeded(H, K)
    want = one_process(q, k, v, do)
    got, pos, _, _ = local(cp_comm, how, q, k, v, do, None)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w[:, pos], rtol=0, atol=1e-12, err_msg=f"{name} on rank {cp_comm.rank}")


@pytest.mark.parametrize("how", list(CONTEXT_ATTENTION))
def test_bytes_closed_form(cp_comm, how):
    """The counted traffic of one forward and one backward equals the closed forms in the module docstring."""
    H, K, cp = 4, 2, cp_comm.size
    Tk = T // cp
    _, _, f, b = local(cp_comm, how, *seeded(H, K), None)
    if how == "ring":
        kv = 2 * B * Tk * K * HD * 8
        assert f == {"send": [2 * (cp - 1), kv * (cp - 1) + 8 * Tk * (cp - 1)],
                     "recv": [2 * (cp - 1), kv * (cp - 1) + 8 * Tk * (cp - 1)]}
        assert b == {"send": [2 * cp - 1, kv * (cp - 1) + kv * cp], "recv": [2 * cp - 1, kv * (cp - 1) + kv * cp]}
    else:
        assert f == {"allgather": [1, 2 * B * T * K * HD * 8]}
        assert b == {"reduce_scatter": [1, 2 * B * T * K * HD * 8]}


@pytest.mark.parametrize("how", list(CONTEXT_ATTENTION))
def test_contiguous_split_skips_without_hanging(cp_comm, how):
    # the first rank sees none of the later ranks' keys: it skips their blocks but passes them on
    q, k, v, do = seeded(4, 2)
    want = one_process(q, k, v, do)
    got, pos, _, _ = local(cp_comm, how, q, k, v, do, contiguous_positions(T, cp_comm.size, cp_comm.rank))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w[:, pos], rtol=0, atol=1e-12)
