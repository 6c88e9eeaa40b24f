"""Tensor parallel (Megatron 2019/2021): the conjugate communication pairs a block is handed, and the
vocabulary-parallel cross-entropy that never gathers the full logits.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from hpengine.models import LocalTP
from hpengine.models.context import LocalSeq
from hpengine.nn.loss import masked, masks


# copy_to_tp is the identity forward and an allreduce backward; reduce_from_tp the reverse. A column-split
# linear sits after copy_to_tp, a row-split linear before reduce_from_tp, so per layer and micro-batch the
# forward costs two allreduces of B·T·C values and the backward two more.
class TensorParallel(LocalTP):
    """The tp part of a context (models/context.py) on tp rank `comm.rank` of `comm.size`; `vocab` is the
    unpadded vocabulary size. The identity halves of the pairs stay LocalTP's."""

    def __init__(self, comm, vocab: int):
        self.comm, self.rank, self.size, self.vocab = comm, comm.rank, comm.size, vocab

    # --- the allreduce halves of the conjugate pairs (each named after its pair) ----------------
    def copy_to_tp_backward(self, dx):
        return self.comm.allreduce_(np.ascontiguousarray(dx) if not dx.flags.c_contiguous else dx)

    def reduce_from_tp(self, x):
        return self.comm.allreduce_(np.ascontiguousarray(x) if not x.flags.c_contiguous else x)

    def sum_partial(self, x):
        # a plain allreduce, also under sequence parallelism (whose pairs gather and scatter instead)
        return self.comm.allreduce_(x if x.flags.c_contiguous else x.copy())

    # --- vocabulary-parallel cross-entropy ------------------------------------------------------
    def cross_entropy_forward(self, xp, logits, targets, norm, mask=None):
        # logits: (B, T, V/tp) this rank's vocabulary slice; targets: (B, T) global ids
        Vl = logits.shape[-1]
        start = self.rank * Vl
        pad = start + Vl - self.vocab
        if pad > 0:                              # padded vocabulary entries never win the softmax
            logits[..., Vl - pad:] = -np.inf
        m = logits.max(axis=-1, keepdims=True)
        self.comm.allreduce_(m, op=MPI.MAX)
        local = targets - start
        inside = (local >= 0) & (local < Vl)
        zt = xp.take_along_axis(logits, xp.where(inside, local, 0)[..., None], axis=-1)[..., 0]
        zt = xp.where(inside, zt - m[..., 0], 0.0)
        p = logits - m
        xp.exp(p, out=p)
        s = p.sum(axis=-1)
        both = xp.stack([s, zt])                 # one allreduce for the sum of exps and the target logit
        self.comm.allreduce_(both)
        s, zt = both[0], both[1]
        loss = masked(xp, xp.log(s) - zt, mask).sum() * (1.0 / float(norm))
        p /= s[..., None]
        return loss, (p, local, inside, float(norm), *masks(mask))

    def cross_entropy_backward(self, xp, cache, dloss=1.0):
        p, local, inside, norm, *mask = cache
        scale = float(dloss) / norm
        d = p * scale
        d2 = d.reshape(-1, d.shape[-1])
        rows = xp.nonzero(inside.reshape(-1))[0]
        d2[rows, local.reshape(-1)[rows]] -= scale
        return masked(xp, d, mask[0]) if mask else d


def sum_over_tp_(comm, g, ranges) -> None:
    """Sum over tp the gradient slices g[a:b] (ranges: (a, b) offsets into g), in one allreduce."""
    if not ranges:
        return
    parts = [g[a:b] for a, b in ranges]
    buf = np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
    comm.allreduce_(buf)
    at = 0
    for p in parts:
        p[...] = buf[at:at + p.size]
        at += p.size


class TensorParallelSeq(LocalSeq):
    """The seq part under plain tensor parallelism: every tp rank holds every position, as on one rank. The
    tensors it sums over tp once a step are those layout/reduction.py marks "tp" without sequence parallelism:
    whole tensors applied to each head (ParamSpec.tp_partial, the q/k norms), whose gradient on a rank covers
    only its heads. Without such tensors `ranges` is empty and nothing is sent."""

    def __init__(self, comm):
        self.comm = comm

    def sum_replicated_(self, g, ranges) -> None:
        sum_over_tp_(self.comm, g, ranges)
