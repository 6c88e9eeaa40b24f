"""Context parallelism's attention over the cp communicator, in its two ways (context_parallel.comm): the
ring passes each rank's keys and values to the next rank while the current block is attended, and the
all-gather collects every key once and reduce-scatters dk, dv back. Packed documents' segments travel with
the keys (host int arrays) and mask by document too. The block math is nn/ring_attention.py.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from hpengine.nn.ring_attention import (
    accumulate_dtype,
    block_backward,
    block_forward,
    block_visible,
    host_positions,
    host_segments,
    merge_partials,
    softmax_delta,
)

# message tags on the cp communicator: keys and values, their positions, their accumulating gradients, their
# documents' segments
TAG_KV, TAG_POS, TAG_DKV, TAG_SEG = 30001, 30002, 30003, 30004
# the tags that are also channels (NCCL's under runtime.collectives = "nccl", matched by issue order): every
# rank walks the same layers, steps and passes, so each rank sends a tag's messages to the next in the order
# that one receives them; the positions are host arrays, which stay on MPI
RING_CHANNELS = (TAG_KV, TAG_DKV)


# The communicator is anything with the CPComm methods (dist.comm.Comm, or a local
# stand-in in the unit tests). Every rank's block has the same shape (the head-tail split's T / cp).
class CPComm(Protocol):
    """What the drivers use of a communicator (dist.comm.Comm has it all)."""
    rank: int
    size: int

    def open_channels(self, wanted) -> None: ...

    def isend(self, arr, dest: int, tag: int, channel=None): ...

    def irecv(self, arr, source: int, tag: int, channel=None): ...

    def allgather_axis1(self, send, recv): ...

    def reduce_scatter(self, send, recv): ...

    def allgather_obj(self, obj) -> list: ...


def _pack(xp, k, v):
    # (2, B, K, Tk, hd) C-contiguous, whatever the strides of k and v: what MPI may send
    return xp.ascontiguousarray(xp.stack([k, v]))


def ring_channels(cp: int) -> list:
    """The ring's channels, (sender, receiver, tag): each rank to the next, for the tags of RING_CHANNELS."""
    return [(r, (r + 1) % cp, tag) for r in range(cp) for tag in RING_CHANNELS] if cp > 1 else []


def _wait(reqs) -> None:
    for r in reqs:
        r.Wait()


# ---- ring ---------------------------------------------------------------------------------------------

def _segment_pair(q_seg, k_seg):
    # host (B, Tq), (B, Tk) int64 segments, or (None, None): both or neither
    if (q_seg is None) != (k_seg is None):
        raise ValueError("segments for the queries and the keys go together: give both or neither")
    return host_segments(q_seg), (None if k_seg is None else np.ascontiguousarray(host_segments(k_seg)))


def ring_attention_forward(xp, comm: CPComm, q, k, v, q_pos, k_pos, scale=None, q_seg=None, k_seg=None,
                           logit_max=False):
    """Causal attention of this rank's q (B, H, Tq, hd) over every rank's keys: k, v (B, K, Tk, hd) and
    k_pos (Tk,) are this rank's, q_pos (Tq,) its queries' global positions (host ints; or (B, Tk), (B, Tq)
    per row: packed documents split per document, positions within each document). cp steps; at each
    the block held goes on to the next rank (Isend/Irecv posted before it is attended, so the transfer
    overlaps the compute) -> o (B, H, Tq, hd) in q's dtype, cache. q_seg (B, Tq), k_seg (B, Tk): packed
    documents' segments (None: one document per row), which go round with the keys; a block with no
    visible key of a query's own document is skipped. logit_max: also return each head's largest visible
    score (H,) over every block these queries attended (block_forward's; the max over cp ranks is the caller's)."""
    cp, r = comm.size, comm.rank
    nxt, prv = (r + 1) % cp, (r - 1) % cp
    qp = host_positions(q_pos)
    qs, seg = _segment_pair(q_seg, k_seg)
    blk, pos = _pack(xp, k, v), np.ascontiguousarray(host_positions(k_pos))      # one message each per step
    o = lse = best = None
    seen = []                                               # (positions, segments) of the block held at each step
    for step in range(cp):
        reqs, nblk, npos, nseg = [], None, None, None
        if step < cp - 1:
            nblk, npos = xp.empty(blk.shape, dtype=blk.dtype), np.empty(pos.shape, dtype=pos.dtype)
            reqs = [comm.irecv(nblk, prv, TAG_KV, channel=TAG_KV), comm.irecv(npos, prv, TAG_POS),
                    comm.isend(blk, nxt, TAG_KV, channel=TAG_KV), comm.isend(pos, nxt, TAG_POS)]
            if seg is not None:
                nseg = np.empty(seg.shape, dtype=seg.dtype)
                reqs += [comm.irecv(nseg, prv, TAG_SEG), comm.isend(seg, nxt, TAG_SEG)]
        seen.append((pos, seg))
        # a block wholly after every query is skipped; the messages above go the same on every rank
        if block_visible(qp, pos, qs, seg):
            part = block_forward(xp, q, blk[0], blk[1], qp, pos, scale, qs, seg, logit_max)
            if logit_max:
                *part, m = part
                best = m if best is None else xp.maximum(best, m)
            o, lse = part if o is None else merge_partials(xp, o, lse, *part)
        _wait(reqs)
        blk, pos, seg = nblk, npos, nseg
    if o is None:
        ct = accumulate_dtype(q.dtype)
        o, lse = xp.zeros(q.shape, dtype=ct), xp.full(q.shape[:3], -xp.inf, dtype=ct)
    if logit_max and best is None:
        best = xp.full(q.shape[1], -xp.inf, dtype=accumulate_dtype(q.dtype))
    out = o.astype(q.dtype, copy=False)
    cache = (q, k, v, out, lse, qp, seen, scale, qs)
    return (out, cache, best) if logit_max else (out, cache)


def ring_attention_backward(xp, comm: CPComm, do, cache):
    """do (B, H, Tq, hd) -> dq (B, H, Tq, hd), dk, dv (B, K, Tk, hd) of this rank's q, k, v. The blocks go
    around the ring again in the forward's order; each carries its dk, dv, to which every rank adds its
    queries' share before passing it on, and after cp steps the sums arrive back at their owner."""
    q, k, v, o, lse, qp, seen, scale, qs = cache
    cp, r = comm.size, comm.rank
    nxt, prv = (r + 1) % cp, (r - 1) % cp
    ct = accumulate_dtype(q.dtype)
    delta = softmax_delta(xp, o, do)
    dq = xp.zeros(q.shape, dtype=ct)
    blk = _pack(xp, k, v)
    gshape = (2,) + tuple(k.shape)
    acc = xp.zeros(gshape, dtype=ct)        # dk, dv so far of the block held (own block: nothing yet)
    arriving = []                           # the receive of acc, posted a step earlier
    gsend = []                              # the send of the previous step's acc
    for step in range(cp):
        reqs, nblk = [], None
        if step < cp - 1:
            nblk = xp.empty(blk.shape, dtype=blk.dtype)
            reqs = [comm.irecv(nblk, prv, TAG_KV, channel=TAG_KV), comm.isend(blk, nxt, TAG_KV, channel=TAG_KV)]
        if cp > 1:      # what the previous rank sends at this step: next step's block (last: our own)
            gnext = xp.empty(gshape, dtype=ct)
            greq = comm.irecv(gnext, prv, TAG_DKV, channel=TAG_DKV)
        grads = None
        pos, seg = seen[step]
        if block_visible(qp, pos, qs, seg):
            dqb, *grads = block_backward(xp, q, blk[0], blk[1], o, lse, do, qp, pos, scale, delta, qs, seg)
            dq += dqb
        _wait(arriving)                     # the block's sums from the ranks it visited before
        if grads is not None:
            acc[0] += grads[0]
            acc[1] += grads[1]
        if cp > 1:
            _wait(gsend)                    # the previous gradient send, before its buffer is dropped
            gsend = [comm.isend(acc, nxt, TAG_DKV, channel=TAG_DKV)]
            acc, arriving = gnext, [greq]
        _wait(reqs)
        blk = nblk
    _wait([*arriving, *gsend])              # acc: this rank's own block, summed over every rank
    return dq.astype(q.dtype, copy=False), acc[0].astype(k.dtype), acc[1].astype(v.dtype)


# ---- all-gather ---------------------------------------------------------------------------------------

def allgather_attention_forward(xp, comm: CPComm, q, k, v, q_pos, k_pos, scale=None, q_seg=None, k_seg=None,
                                logit_max=False):
    """As ring_attention_forward, with every rank's k, v gathered at once (one all-gather, their
    positions, and segments when given, as a small control message) and attended locally -> o (B, H, Tq,
    hd), cache (and with logit_max each head's largest visible score)."""
    cp = comm.size
    B, K, Tk, hd = k.shape
    send = _pack(xp, k, v).reshape(2 * B * K, Tk, hd)
    recv = xp.empty((2 * B * K, cp * Tk, hd), dtype=send.dtype)
    comm.allgather_axis1(send, recv)
    kv = recv.reshape(2, B, K, cp * Tk, hd)
    qs, ks = _segment_pair(q_seg, k_seg)
    if ks is None:
        pos = np.concatenate([host_positions(p) for p in comm.allgather_obj(host_positions(k_pos).tolist())], axis=-1)
    else:
        got = comm.allgather_obj((host_positions(k_pos).tolist(), ks.tolist()))
        pos = np.concatenate([host_positions(p) for p, _ in got], axis=-1)
        ks = np.concatenate([host_segments(s).reshape(ks.shape) for _, s in got], axis=1)
    qp = host_positions(q_pos)
    o, lse, *best = block_forward(xp, q, kv[0], kv[1], qp, pos, scale, qs, ks, logit_max)
    out = o.astype(q.dtype, copy=False)
    return (out, (q, kv, out, lse, qp, pos, scale, qs, ks), *best)


def allgather_attention_backward(xp, comm: CPComm, do, cache):
    """do (B, H, Tq, hd) -> dq, dk, dv of this rank's q, k, v: this rank's queries give gradients for
    every key, which a reduce-scatter sums onto each key's owner."""
    q, kv, o, lse, qp, pos, scale, qs, ks = cache
    cp = comm.size
    _, B, K, T, hd = kv.shape
    dq, dk, dv = block_backward(xp, q, kv[0], kv[1], o, lse, do, qp, pos, scale, q_seg=qs, k_seg=ks)
    # (2, B, K, cp, Tk, hd) -> (cp, 2, B, K, Tk, hd): owner r's keys are block r of the reduce-scatter
    send = xp.ascontiguousarray(xp.stack([dk, dv]).reshape(2, B, K, cp, T // cp, hd).transpose(3, 0, 1, 2, 4, 5))
    recv = xp.empty((2, B, K, T // cp, hd), dtype=send.dtype)
    comm.reduce_scatter(send, recv)
    dt = kv.dtype
    return dq.astype(q.dtype, copy=False), recv[0].astype(dt), recv[1].astype(dt)


# the attention pair of each context_parallel.comm setting
CONTEXT_ATTENTION = {
    "ring": (ring_attention_forward, ring_attention_backward),
    "allgather": (allgather_attention_forward, allgather_attention_backward),
}
