"""The parallel context a model's blocks are handed: one named part per kind of communication. `tp` the
tensor-parallel conjugate pairs and loss, `seq` this rank's piece of each sequence, `attn` the keys and values an
attention sees, `ep` tokens sent to experts, `logits` where MuonClip's largest logits go; `num` the precision policy;
`docs` the micro-batch's packed documents; `ahead` its multi-token prediction targets. LOCAL: every part the identity.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

from hpengine.nn import OFF, Numerics, cross_entropy_backward, cross_entropy_forward
from hpengine.nn.logit_max import causal_max_logits, fused_max_logits

__all__ = ["LOCAL", "Ahead", "Context", "Documents", "LocalAttn", "LocalEP", "LocalLogits", "LocalSeq", "LocalTP",
           "local_context", "with_documents"]


class LocalTP:
    """Tensor-parallel conjugate pairs for tp = 1, each the identity (strategies.TensorParallel subclasses it
    and replaces the halves that communicate), and the whole-vocabulary cross-entropy."""
    rank, size = 0, 1

    def copy_to_tp(self, x):                 # identity forward ...
        return x

    def copy_to_tp_backward(self, dx):       # ... allreduce backward
        return dx

    def reduce_from_tp(self, x):             # allreduce forward ...
        return x

    def reduce_from_tp_backward(self, dx):   # ... identity backward
        return dx

    def sum_partial(self, x):                # every rank's share of a small replicated value, summed
        return x

    def cross_entropy_forward(self, xp, logits, targets, norm, mask=None):
        return cross_entropy_forward(xp, logits, targets, norm, mask)

    def cross_entropy_backward(self, xp, cache, dloss=1.0):
        return cross_entropy_backward(xp, cache, dloss)


class LocalSeq:
    """Where this rank's tokens sit in each sequence, for a rank that holds them all (the sequence-parallel
    part is strategies/sequence_parallel.py: SequenceSplit)."""
    parts = 1                                # pieces the sequence is cut into between tp regions

    def local_positions(self, n: int) -> slice:
        """Positions of this rank's n tokens of each sequence."""
        return slice(0, n)

    def local_columns(self, n: int):
        """Where this rank's n tokens sit among the columns of its micro-batch's fields (a Batch already cut
        for context parallelism): its per-token documents and positions are read there."""
        return self.local_positions(n)

    def stash_inputs(self, x, *caches):
        """The linear caches of a region's entry, whose input is copy_to_tp(x), as the forward keeps them."""
        return caches

    def unstash_inputs(self, stash):
        """The linear caches stash_inputs kept, whole again."""
        return stash

    def stashed_caches(self, stash):
        """The linear caches stash_inputs kept, as kept: nothing is gathered, so an input may be missing,
        which an input gradient does not read (tp_layers' split backwards, B half)."""
        return stash

    def sum_replicated_(self, g, ranges) -> None:
        """Gradients of tensors every tp rank holds whole: already equal on every rank."""


class LocalAttn:
    """The attention of this rank's queries, when every key they need is this rank's. Under context parallelism
    (strategies/context_attention.py) each rank holds part of every sequence and the whole attention call is
    replaced: keys travel by ring or all-gather and the causal mask compares global positions. A model hands
    its own core pair to the call; the local part just runs it.

    kv_forward / kv_backward: a hook on the keys and values a core reads (in its layout; a fused-qkv core hands
    its qkv as k and None as v), the identity here.

    logits (the forwards' last argument): None, or where the heads' largest visible logits of this call go
    (MuonClip, a callable taking (H,)); here measured from the q and k the core is handed (nn/logit_max.py)."""
    size = 1
    local_core = True       # the model's own core runs (on bfloat16 bits where it may); False: a driver replaces it
    segments = None         # (B, T) device document ids of a micro-batch that packs documents, else None

    def rows(self, table):
        """The rows of a per-position table (rotary cos or sin, (T, n)) for the positions this rank's
        attention sees, in its order: here every position from 0, as the table is."""
        return table

    def sequence_sum(self, x):
        """Per-sequence figures (B, ...) of this rank's tokens summed over every rank holding part of the same
        sequences: here the rank holds them whole."""
        return x

    def grouped_forward(self, xp, core, q, k, v, scale=None, logits=None):
        # q: (B, H, T, hd), k, v: (B, K, T, hd) -> y: (B, T, H*hd), cache. core(xp, q, k, v) -> (y, cache) is the
        # model's local core; scale: the scores' factor (None: 1/sqrt(hd); 1.0 for a q already scaled)
        if logits is not None:
            sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            logits(causal_max_logits(xp, q if sc == 1.0 else q * sc, k, self.segments))
        return core(xp, q, k, v)

    def grouped_backward(self, xp, core_backward, dy, cache):
        # dy: (B, T, H*hd) -> dq: (B, H, T, hd), dk, dv: (B, K, T, hd)
        return core_backward(xp, dy, cache)

    def fused_forward(self, xp, core, qkv, n_heads, logits=None):
        # qkv: (B, T, H*3*hd) head-major ([h][q, k, v][d] columns) -> y: (B, T, H*hd), cache; scale 1/sqrt(hd)
        if logits is not None:
            logits(fused_max_logits(xp, qkv, n_heads, self.segments))
        return core(xp, qkv, n_heads)

    def fused_backward(self, xp, core_backward, dy, cache):
        # dy: (B, T, H*hd) -> dqkv: (B, T, H*3*hd) head-major
        return core_backward(xp, dy, cache)

    def for_documents(self, segments, positions=None):
        """This part for a micro-batch that packs documents (segments, positions within documents, (B, T)
        device ints or None): the local cores take them from ctx.docs themselves; the largest logits are measured
        within each document."""
        part = copy.copy(self)
        part.segments = segments
        return part

    def kv_forward(self, k, v):
        # k, v: this rank's keys and values -> the keys and values its queries attend to
        return k, v

    def kv_backward(self, dk, dv):
        # dk, dv: gradients of what kv_forward returned -> those of its k, v
        return dk, dv


class LocalEP:
    """Routed rows to their experts and back when every expert is this rank's (strategies/expert_parallel.py
    sends them over the ep ranks). Rows come sorted by expert, with their counts per expert; `plan` is what
    dispatch learned, which the other three reuse."""
    rank, size = 0, 1

    def dispatch(self, xs, counts):
        # xs: (S, C) sorted by expert, counts: (E,) -> (rows of this rank's experts by local expert, their
        # counts per local expert, plan)
        return xs, counts, None

    def dispatch_backward(self, dxs, plan):
        # dxs: gradients of dispatch's rows -> (S, C) in this rank's order
        return dxs

    def combine(self, ys, plan):
        # ys: the local experts' outputs, as dispatch returned the rows -> (S, C) back in this rank's order
        return ys

    def combine_backward(self, dys, plan):
        # dys: (S, C) -> gradients of combine's input
        return dys


class LocalLogits:
    """Where an attention layer reports its heads' largest logits: nowhere (models/attention_logits.py collects
    them while MuonClip is on). Its sink is None, so the off path measures nothing."""

    def record(self, layer: int, maxima) -> None:
        """maxima: (this rank's query heads,) the largest logit of layer `layer`'s heads in one forward."""

    def sink(self, layer: int):
        """What layer `layer` hands its attention call as `logits` in a training forward: None, nothing measured."""
        return None


@dataclass(frozen=True)
class Documents:
    """A micro-batch's packed documents, (rows, T) device arrays of the whole sequence, any of them None (its
    default): segments (each token's document within its row: attention stays inside it), positions (within
    its document: rotary angles, position embeddings), loss_mask (1 where a target counts)."""
    segments: object = None
    positions: object = None
    loss_mask: object = None


@dataclass(frozen=True)
class Ahead:
    """What multi-token prediction's losses read in a training pass (models/mtp.py): ids, (B, T, depth) device ints,
    data.Batch.ahead (the target of depth k in column k - 1, -1 where none counts); norms, each depth's loss divisor
    over the global batch; scale, the amp loss scale (1 without); record(loss), where the mean of the depths'
    losses goes for the metrics (None: nowhere)."""
    ids: object
    norms: tuple
    scale: float = 1.0
    record: object = None


@dataclass(frozen=True)
class Context:
    """What a block may communicate through, by concern, and the precision its layers compute in (num: every
    layer call takes it, or its float32_out for an output a float32 reader takes); every block function
    takes one."""
    tp: LocalTP
    seq: LocalSeq
    attn: LocalAttn
    ep: LocalEP
    num: Numerics = OFF
    logits: LocalLogits = LocalLogits()
    docs: Documents | None = None
    ahead: Ahead | None = None


LOCAL = Context(LocalTP(), LocalSeq(), LocalAttn(), LocalEP())


def with_documents(ctx: Context, batch) -> Context:
    """ctx handing the layers a data.Batch's documents; ctx itself when the batch holds only their defaults."""
    if batch.defaults_only():
        return ctx
    attn = ctx.attn if batch.segments is None else ctx.attn.for_documents(batch.segments, batch.positions)
    return replace(ctx, docs=Documents(batch.segments, batch.positions, batch.loss_mask), attn=attn)


def local_context() -> Context:
    """The one-rank context (LOCAL): every part the identity."""
    return LOCAL
