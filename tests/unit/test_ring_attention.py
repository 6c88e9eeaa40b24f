"""Context-parallel attention without MPI: the block kernels, the merge rule, and the ring and all-gather
drivers run by cp threads over an in-process communicator, against plain causal softmax attention
written out here with NumPy (the oracle), its hand-derived gradient and central differences."""
import threading
from collections import Counter, defaultdict

import numpy as np
import pytest

from hpengine.nn.context_split import contiguous_positions, head_tail_positions
from hpengine.nn.ring_attention import (
    block_backward,
    block_forward,
    block_visible,
    merge_partials,
)
from hpengine.strategies.context_parallel import CONTEXT_ATTENTION

TIMEOUT = 30.0


# ---- the oracle --------------------------------------------------------------------------------------

def oracle(q, k, v, qp, kp, scale):
    """Plain causal attention: q (B, H, Tq, hd), k, v (B, K, Tk, hd), query at qp sees keys at kp <= qp.
    -> o, and the probabilities (rows that see no key: all zero)."""
    g = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("bhtd,bhsd->bhts", q, kr) * scale
    masked = np.asarray(kp)[None, :] > np.asarray(qp)[:, None]
    s = np.where(masked, -np.inf, s)
    mx = s.max(axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.exp(s - mx)
    tot = e.sum(axis=-1, keepdims=True)
    p = e / np.where(tot > 0, tot, 1.0)
    return np.einsum("bhts,bhsd->bhtd", p, vr), p


def oracle_grad(q, k, v, do, qp, kp, scale):
    """The gradient of sum(o * do), from the softmax Jacobian written out: ds = p (dp - rowsum(dp p))."""
    B, H, _, hd = q.shape
    K = k.shape[1]
    g = H // K
    _, p = oracle(q, k, v, qp, kp, scale)
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    dp = np.einsum("bhtd,bhsd->bhts", do, vr)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhts,bhsd->bhtd", ds, kr) * scale
    dk = np.einsum("bhts,bhtd->bhsd", ds, q).reshape(B, K, g, -1, hd).sum(axis=2) * scale
    dv = np.einsum("bhts,bhtd->bhsd", p, do).reshape(B, K, g, -1, hd).sum(axis=2)
    return dq, dk, dv


# ---- cp ranks as threads over an in-process communicator ----------------------------------------------

class _Sent:
    def Wait(self):
        pass


class _Recv:
    def __init__(self, group, key, arr):
        self.group, self.key, self.arr = group, key, arr

    def Wait(self):
        g = self.group
        with g.cond:
            if not g.cond.wait_for(lambda: self.key in g.mail or g.failed, TIMEOUT) or g.failed:
                raise RuntimeError(f"no message {self.key}")
            self.arr[...] = g.mail.pop(self.key)


class LocalGroup:
    """cp ranks in one process: messages match in posting order per (source, dest, tag), as MPI's."""

    def __init__(self, n):
        self.n, self.cond, self.mail, self.failed = n, threading.Condition(), {}, False
        self.sent, self.posted = Counter(), Counter()
        self.barrier = threading.Barrier(n, timeout=TIMEOUT)
        self.slots = [None] * n


class LocalComm:
    def __init__(self, group, rank):
        self.g, self.rank, self.size = group, rank, group.n
        self.stats = defaultdict(lambda: [0, 0])

    def _count(self, op, arr):
        assert arr.flags.c_contiguous, f"{op} of a strided buffer: MPI refuses it"
        self.stats[op][0] += 1
        self.stats[op][1] += int(arr.nbytes)

    def isend(self, arr, dest, tag, channel=None):
        self._count("send", arr)
        with self.g.cond:
            key = (self.rank, dest, tag)
            self.g.mail[key + (self.g.sent[key],)] = np.array(arr, copy=True)
            self.g.sent[key] += 1
            self.g.cond.notify_all()
        return _Sent()

    def irecv(self, arr, source, tag, channel=None):
        self._count("recv", arr)
        with self.g.cond:
            key = (source, self.rank, tag)
            seq = self.g.posted[key]
            self.g.posted[key] += 1
        return _Recv(self.g, key + (seq,), arr)

    def _exchange(self, obj):
        self.g.slots[self.rank] = obj
        self.g.barrier.wait()
        got = list(self.g.slots)
        self.g.barrier.wait()
        return got

    def allgather_axis1(self, send, recv):
        if self.size > 1:
            self._count("allgather", recv)
        recv[...] = np.concatenate(self._exchange(np.array(send, copy=True)), axis=1)
        return recv

    def reduce_scatter(self, send, recv):
        if self.size > 1:
            self._count("reduce_scatter", send)
        parts = self._exchange(np.array(send, copy=True))
        recv[...] = sum(p[self.rank] for p in parts)
        return recv

    def allgather_obj(self, obj):
        return self._exchange(obj)


def on_ranks(cp, fn):
    """fn(comm) on cp threads, one per rank -> their results in rank order (the first error re-raised)."""
    group = LocalGroup(cp)
    comms = [LocalComm(group, r) for r in range(cp)]
    out, errs = [None] * cp, []

    def body(r):
        try:
            out[r] = fn(comms[r])
        except BaseException as e:          # noqa: BLE001 - handed to the test thread
            errs.append(e)
            with group.cond:
                group.failed = True
                group.cond.notify_all()
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT)
    if errs:
        raise errs[0]
    return out, comms


# ---- data and the distributed run --------------------------------------------------------------------

def data(B, H, K, T, hd, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, T, hd)), rng.standard_normal((B, K, T, hd)),
            rng.standard_normal((B, K, T, hd)), rng.standard_normal((B, H, T, hd)))


def positions(T, cp, split):
    f = head_tail_positions if split == "head_tail" else contiguous_positions
    return [f(T, cp, r) for r in range(cp)]


def distributed(how, q, k, v, do, cp, split="head_tail", backward=True):
    """Each rank takes its part of q, k, v (and do); -> the whole o, dq, dk, dv reassembled, and the comms."""
    T = q.shape[2]
    pos = positions(T, cp, split)
    fwd, bwd = CONTEXT_ATTENTION[how]

    def part(a, p):
        # (B, heads, Tk, hd) as a strided view of (B, Tk, heads, hd), as a projection's output is seen
        return np.ascontiguousarray(a[:, :, p].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)

    def rank(comm):
        p = pos[comm.rank]
        o, cache = fwd(np, comm, part(q, p), part(k, p), part(v, p), p, p)
        return (o, *bwd(np, comm, part(do, p), cache)) if backward else (o,)

    res, comms = on_ranks(cp, rank)
    whole = []
    for i, ref in enumerate((q, q, k, v)[:len(res[0])]):
        full = np.empty_like(ref)
        for r, p in enumerate(pos):
            full[:, :, p] = res[r][i]
        whole.append(full)
    return whole, comms


HEADS = [(2, 2), (4, 2), (4, 1)]        # (H, K): multi-head, grouped, multi-query


@pytest.mark.parametrize("how", list(CONTEXT_ATTENTION))
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("H,K", HEADS)
def test_equals_oracle(how, cp, H, K):
    B, T, hd = 2, 16, 4
    q, k, v, do = data(B, H, K, T, hd)
    (o, dq, dk, dv), _ = distributed(how, q, k, v, do, cp)
    ar = np.arange(T)
    want_o, _ = oracle(q, k, v, ar, ar, 1 / np.sqrt(hd))
    np.testing.assert_allclose(o, want_o, rtol=0, atol=1e-12)
    for got, want in zip((dq, dk, dv), oracle_grad(q, k, v, do, ar, ar, 1 / np.sqrt(hd))):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("how", list(CONTEXT_ATTENTION))
def test_contiguous_split_skips_blocks(how):
    # rank 0's queries see none of the later ranks' keys: those blocks are skipped, the messages are not
    B, H, K, T, hd, cp = 1, 4, 2, 16, 4, 4
    q, k, v, do = data(B, H, K, T, hd, seed=1)
    (o, dq, dk, dv), comms = distributed(how, q, k, v, do, cp, split="contiguous")
    ar = np.arange(T)
    np.testing.assert_allclose(o, oracle(q, k, v, ar, ar, 0.5)[0], rtol=0, atol=1e-12)
    for got, want in zip((dq, dk, dv), oracle_grad(q, k, v, do, ar, ar, 0.5)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert len({tuple(sorted((op, tuple(s)) for op, s in c.stats.items())) for c in comms}) == 1


def test_ring_bytes():
    """Per rank, forward sends (cp - 1) blocks of k and v, 2 B Tk K hd elements each, plus their Tk int64
    positions; backward sends the k, v blocks again (cp - 1 times) and the dk, dv blocks cp times (the
    last returns the sums to their owners)."""
    B, H, K, T, hd, cp = 2, 4, 2, 16, 4, 4
    q, k, v, do = data(B, H, K, T, hd)
    Tk = T // cp
    pos = positions(T, cp, "head_tail")
    fwd, bwd = CONTEXT_ATTENTION["ring"]
    kv = 2 * B * Tk * K * hd * 8

    def rank(comm):
        p = pos[comm.rank]
        _, cache = fwd(np, comm, q[:, :, p], k[:, :, p], v[:, :, p], p, p)
        sent = dict(comm.stats)
        comm.stats.clear()
        bwd(np, comm, do[:, :, p], cache)
        return sent, dict(comm.stats)

    res, _ = on_ranks(cp, rank)
    for f, b in res:
        assert f["send"] == f["recv"] == [2 * (cp - 1), (cp - 1) * (kv + 8 * Tk)]
        assert b["send"] == b["recv"] == [2 * cp - 1, (cp - 1) * kv + cp * kv]


@pytest.mark.parametrize("how", list(CONTEXT_ATTENTION))
def test_finite_differences(how):
    B, H, K, T, hd, cp = 1, 4, 2, 8, 4, 2
    q, k, v, _ = data(B, H, K, T, hd, seed=2)
    w = np.random.default_rng(3).standard_normal(q.shape)      # loss = sum(o * w)
    (_, dq, dk, dv), _ = distributed(how, q, k, v, w, cp)

    def loss(q, k, v):
        return float((distributed(how, q, k, v, w, cp, backward=False)[0][0] * w).sum())

    rng, eps = np.random.default_rng(4), 1e-5
    for i, (x, grad) in enumerate(((q, dq), (k, dk), (v, dv))):
        for _ in range(3):
            idx = tuple(int(rng.integers(n)) for n in x.shape)
            args = [q, k, v]
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args[i] = plus
            lp = loss(*args)
            args[i] = minus
            lm = loss(*args)
            assert abs((lp - lm) / (2 * eps) - grad[idx]) < 1e-8, (i, idx)


# ---- the block kernels --------------------------------------------------------------------------------

def test_fully_masked_rows():
    # queries at 0..3 over keys at 2..5: rows 0 and 1 see no key of this block
    B, H, K, hd = 1, 4, 2, 4
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((B, H, 4, hd)), rng.standard_normal((B, K, 4, hd)), rng.standard_normal((B, K, 4, hd))
    qp, kp = np.arange(4), np.arange(2, 6)
    o, lse = block_forward(np, q, k, v, qp, kp)
    assert np.isfinite(o).all()
    assert np.isneginf(lse[:, :, :2]).all() and np.isfinite(lse[:, :, 2:]).all()
    np.testing.assert_array_equal(o[:, :, :2], 0.0)
    np.testing.assert_allclose(o, oracle(q, k, v, qp, kp, 0.5)[0], rtol=0, atol=1e-12)
    # merged with a block every row sees, the empty rows take that block alone
    k2, v2 = rng.standard_normal((B, K, 2, hd)), rng.standard_normal((B, K, 2, hd))
    o2, lse2 = block_forward(np, q, k2, v2, qp, np.arange(-2, 0))
    mo, _ = merge_partials(np, o, lse, o2, lse2)
    kk, vv, kpp = np.concatenate([k, k2], axis=2), np.concatenate([v, v2], axis=2), np.concatenate([kp, [-2, -1]])
    np.testing.assert_allclose(mo, oracle(q, kk, vv, qp, kpp, 0.5)[0], rtol=0, atol=1e-12)
    # two empty rows merge to an empty row, no NaN
    eo, else_ = merge_partials(np, o[:, :, :2], lse[:, :, :2], o[:, :, :2], lse[:, :, :2])
    assert np.isneginf(else_).all() and (eo == 0).all()
    # backward from a final lse of -inf (rows that saw no key anywhere): zero gradients, finite
    do = rng.standard_normal(o.shape)
    dq, dk, dv = block_backward(np, q, k, v, o, lse, do, qp, kp)
    assert all(np.isfinite(a).all() for a in (dq, dk, dv))
    np.testing.assert_array_equal(dq[:, :, :2], 0.0)
    want = oracle_grad(q[:, :, 2:], k, v, do[:, :, 2:], qp[2:], kp, 0.5)
    np.testing.assert_allclose(dq[:, :, 2:], want[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(dk, want[1], rtol=0, atol=1e-12)
    np.testing.assert_allclose(dv, want[2], rtol=0, atol=1e-12)


def test_blocks_in_any_order_and_scale():
    # keys dealt into blocks of shuffled positions; merged in any order they give the oracle
    B, H, K, T, hd = 2, 4, 2, 12, 4
    q, k, v, do = data(B, H, K, T, hd, seed=6)
    perm = np.random.default_rng(7).permutation(T)
    blocks = [perm[:5], perm[5:9], perm[9:]]
    qp, ar = np.arange(T), np.arange(T)
    o = lse = None
    for b in reversed(blocks):
        part = block_forward(np, q, k[:, :, b], v[:, :, b], qp, b, scale=1.0)
        o, lse = part if o is None else merge_partials(np, o, lse, *part)
    np.testing.assert_allclose(o, oracle(q, k, v, qp, ar, 1.0)[0], rtol=0, atol=1e-12)
    dq = np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for b in blocks:
        g = block_backward(np, q, k[:, :, b], v[:, :, b], o, lse, do, qp, b, scale=1.0)
        dq += g[0]
        dk[:, :, b], dv[:, :, b] = g[1], g[2]
    for got, want in zip((dq, dk, dv), oracle_grad(q, k, v, do, qp, ar, 1.0)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_block_visible():
    assert block_visible([0, 1, 6, 7], [2, 3, 4, 5])
    assert not block_visible([0, 1, 2, 3], [4, 5, 6, 7])
    assert block_visible([4], [4])
    with pytest.raises(ValueError, match="3 query heads"):
        block_forward(np, *data(1, 3, 2, 4, 2)[:3], np.arange(4), np.arange(4))
