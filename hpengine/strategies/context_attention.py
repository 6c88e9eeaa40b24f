"""The context-parallel parts of the parallel context (models/context.py): each cp rank holds the head-tail
part of every sequence (nn/context_split.py), T / cp tokens at known global positions; of packed documents,
its head-tail part of every document, at per-row positions within them. ContextAttention
(ctx.attn) replaces a model's attention call; ContextSeq (ctx.seq) reads position tables at global positions.
"""
from __future__ import annotations

import copy

import numpy as np

from hpengine.models.context import LocalAttn, LocalSeq
from hpengine.nn.context_split import head_tail_positions
from hpengine.nn.ring_attention import host_positions, host_segments
from hpengine.strategies.context_parallel import CONTEXT_ATTENTION, ring_channels


def _as_heads(y, H):
    # (B, T, H*hd) -> the view (B, H, T, hd)
    B, T, C = y.shape
    return y.reshape(B, T, H, C // H).transpose(0, 2, 1, 3)


def _merge_heads(xp, o):
    # (B, H, T, hd) -> (B, T, H*hd), a new contiguous array
    B, H, T, hd = o.shape
    return xp.ascontiguousarray(o.transpose(0, 2, 1, 3)).reshape(B, T, H * hd)


def _qkv_heads(qkv, H):
    # (B, T, H*3*hd) head-major -> three views (B, H, T, hd): q, k, v
    B, T, C3 = qkv.shape
    v = qkv.reshape(B, T, H, 3, C3 // (3 * H))
    return [v[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3)]


# ContextAttention (ctx.attn) replaces a model's whole attention call: q, k, v of this rank's tokens go to the
# ring or all-gather driver of strategies/context_parallel.py, which attends over every rank's keys under the
# causal mask of global positions (only the key/value heads travel), and back. The drivers' block math is
# flash-style (online softmax, row log-sum-exp kept, no T x T probabilities), so it serves the standard and
# the flash path alike; the model's local core is not called. Rotary tables are read at the global positions.
# Packed documents: for_documents hands a micro-batch's segments and positions within documents (this rank's
# part of each row, document_split's) to a copy of the part, and the drivers mask by (segment, position) pairs
# per row (keys carry theirs round the ring or in the all-gather): a document's order is its positions' order.
# MuonClip's largest logits (logits=) come from the drivers' own scores, over this rank's queries and every
# visible key; the max over the cp ranks is the clip's (optim/qk_clip.py reduces over every rank).
class ContextAttention(LocalAttn):
    """ctx.attn under context parallelism: comm the cp communicator, how ("ring" or "allgather"), T the whole
    sequence length; this rank holds the tokens at head_tail_positions(T, cp, comm.rank)."""
    local_core = False      # the ring or all-gather drivers compute the attention, on float32
    segments = None         # host (B, T / cp) document ids of this rank's tokens (packed documents), or None
    documents = None        # host (B, T / cp) their positions within their documents, or None

    def __init__(self, comm, how: str, T: int, xp=np):
        self.comm, self.how, self.size = comm, how, comm.size
        self.forward, self.backward = CONTEXT_ATTENTION[how]
        self.positions = head_tail_positions(T, comm.size, comm.rank)       # host int64, ascending
        self._index = xp.asarray(self.positions)
        self._rows = {}                    # id(table) -> (table, its rows at our positions)
        if how == "ring":                  # every cp rank builds its context at the same point
            comm.open_channels(ring_channels(comm.size))

    def rows(self, table):
        hit = self._rows.get(id(table))
        if hit is None or hit[0] is not table:
            hit = self._rows[id(table)] = (table, table[self._index])
        return hit[1]

    def for_documents(self, segments, positions=None):
        part = copy.copy(self)              # shares the communicator and the table rows
        part.segments = host_segments(segments)
        if positions is not None:
            part.documents = np.ascontiguousarray(host_positions(positions))
        return part

    def _positions(self):
        # what the drivers mask by: per-row positions within documents, else the head-tail global positions
        return self.positions if self.documents is None else self.documents

    def sequence_sum(self, x):
        return self.comm.allreduce_(x)

    def _check(self, n: int) -> None:
        if n != self.positions.size:
            raise ValueError(f"context parallel attention got {n} positions per sequence; this rank holds "
                             f"{self.positions.size} (seq_len / cp)")

    def grouped_forward(self, xp, core, q, k, v, scale=None, logits=None):
        self._check(q.shape[2])
        pos, seg = self._positions(), self.segments
        o, cache, *best = self.forward(xp, self.comm, q, k, v, pos, pos, scale, seg, seg, logits is not None)
        if logits is not None:
            logits(*best)
        return _merge_heads(xp, o), cache

    def grouped_backward(self, xp, core_backward, dy, cache):
        H = cache[0].shape[1]              # both drivers' caches start with q (B, H, T, hd)
        return self.backward(xp, self.comm, _as_heads(dy, H), cache)

    def fused_forward(self, xp, core, qkv, n_heads, logits=None):
        q, k, v = _qkv_heads(qkv, n_heads)
        self._check(q.shape[2])
        pos, seg = self._positions(), self.segments
        o, cache, *best = self.forward(xp, self.comm, q, k, v, pos, pos, None, seg, seg, logits is not None)
        if logits is not None:
            logits(*best)
        return _merge_heads(xp, o), (cache, qkv.shape)

    def fused_backward(self, xp, core_backward, dy, cache):
        cache, shape = cache
        H = cache[0].shape[1]
        dq, dk, dv = self.backward(xp, self.comm, _as_heads(dy, H), cache)
        dqkv = xp.empty(shape, dtype=dy.dtype)
        for dst, src in zip(_qkv_heads(dqkv, H), (dq, dk, dv)):
            dst[...] = src
        return dqkv


# ContextSeq (ctx.seq) wraps the seq part the layout has otherwise (one rank's, plain tp's or sequence
# parallel's): a position table (gpt's wpe) is read, and its gradient scattered, at the global positions of
# this rank's tokens; everything else is the inner part's.
class ContextSeq(LocalSeq):
    """ctx.seq under context parallelism: `inner` the seq part the layout has besides (its positions count
    within this rank's T / cp tokens, e.g. a sequence-parallel piece of them), `positions` this rank's global
    positions (ContextAttention.positions)."""

    def __init__(self, inner, positions, xp=np):
        self.inner, self.parts = inner, inner.parts
        self._index = xp.asarray(positions)

    def local_positions(self, n: int):
        return self._index[self.inner.local_positions(n)]

    def local_columns(self, n: int):
        return self.inner.local_columns(n)       # the Batch is already this rank's T / cp columns

    def stash_inputs(self, x, *caches):
        return self.inner.stash_inputs(x, *caches)

    def unstash_inputs(self, stash):
        return self.inner.unstash_inputs(stash)

    def stashed_caches(self, stash):
        return self.inner.stashed_caches(stash)

    def sum_replicated_(self, g, ranges) -> None:
        self.inner.sum_replicated_(g, ranges)
