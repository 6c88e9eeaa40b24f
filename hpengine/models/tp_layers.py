"""Tensor-parallel layer pairs over a parallel context (models/context.py): the column-split linear that
enters a tp region, the row-split linear that leaves it, the vocabulary-parallel embedding and the
vocabulary-parallel output projection with its loss. Under LOCAL each is its nn/ layer; the models
build their blocks from these rather than calling the conjugate pairs themselves.
"""
from __future__ import annotations

from hpengine.nn import (
    embedding_backward,
    embedding_forward,
    linear_backward,
    linear_backward_input,
    linear_backward_weight,
    linear_forward,
    weight_grad,
)

__all__ = ["column_backward", "column_backward_input", "column_backward_weight", "column_forward",
           "columns_backward", "columns_backward_input", "columns_backward_weight", "columns_forward",
           "row_backward", "row_backward_input", "row_backward_weight", "row_forward", "vocab_embed_backward",
           "vocab_embed_forward", "vocab_loss_backward", "vocab_loss_forward"]


def columns_forward(xp, ctx, x, ws, bs=None, nums=()):
    # x: (B, T_local, C), ws[i]: (C, OC_i / tp) -> ([(B, T, OC_i / tp)], stash): linears sharing one input;
    # nums[i]: the policy linear i is handed, ctx.num where its output is stored as bf16 amp stores what GEMMs
    # and bits-reading kernels take (nn/linear.linear_forward); ctx.num.float32_out, the default, otherwise
    h = ctx.tp.copy_to_tp(x)
    ys, caches = [], []
    nums = tuple(nums) + (ctx.num.float32_out,) * (len(ws) - len(nums))
    with ctx.num.converted(xp, h):          # bf16 amp: the shared input converted once for all the linears
        for w, b, num in zip(ws, bs or (None,) * len(ws), nums):
            y, c = linear_forward(xp, h, w, b, num)
            ys.append(y)
            caches.append(c)
    # sequence parallel: the caches keep this rank's piece x, not the gathered h
    return ys, ctx.seq.stash_inputs(x, *caches)


# Each backward takes `defer`: None runs it fused, as always; a list gets the weight-gradient products queued
# on it (nn/deferred.py) after the input gradient is computed, for a zero-bubble pipeline's W pass.
def columns_backward(xp, ctx, dys, stash, ws, gws, gbs=None, defer=None):
    # dys[i]: (B, T, OC_i / tp) -> dx: (B, T_local, C), the sum over the linears in their order
    if defer is not None:
        dx = columns_backward_input(xp, ctx, dys, stash, ws)
        weight_grad(defer, columns_backward_weight, xp, ctx, dys, stash, gws, gbs, held=(dys, stash))
        return dx
    caches = ctx.seq.unstash_inputs(stash)
    dh = None
    with ctx.num.converted(xp, caches[0][0]):   # the linears' one input (their caches view it), converted once
        for dy, c, w, gw, gb in zip(dys, caches, ws, gws, gbs or (None,) * len(ws)):
            d = linear_backward(xp, dy, c, w, gw, gb, ctx.num)
            if dh is None:
                dh = d
            else:
                dh += d
    return ctx.tp.copy_to_tp_backward(dh)


# The linears' backwards also come as two halves for a zero-bubble pipeline (Qi et al. 2023): `*_input` (B, the
# input gradient the previous stage waits for) and `*_weight` (W, the weight gradients, run later). Together
# they accumulate bit for bit what the fused backward does and run the same collectives, one of them later:
# a column linear's gather of its stashed input (sequence parallelism) moves into W.
def columns_backward_input(xp, ctx, dys, stash, ws):
    # dys[i]: (B, T, OC_i / tp) -> dx: (B, T_local, C), the sum over the linears in their order
    """The input half (B) of columns_backward: dx = copy_to_tp_backward(sum of dys[i] @ ws[i].T), no weight
    gradient. It reads no stashed input (ctx.seq.stashed_caches): dx needs none, so nothing is gathered here."""
    caches = ctx.seq.stashed_caches(stash)
    dh = None
    for dy, c, w in zip(dys, caches, ws):
        d = linear_backward_input(xp, dy, c, w, ctx.num)
        if dh is None:
            dh = d
        else:
            dh += d
    return ctx.tp.copy_to_tp_backward(dh)


def columns_backward_weight(xp, ctx, dys, stash, gws, gbs=None):
    # dys[i]: (B, T, OC_i / tp) -> None; gws[i] += h.T @ dys[i], gbs[i] += column sums of dys[i]
    """The weight half (W) of columns_backward. Under sequence parallelism the stashed input is this rank's
    piece of h, and the all-gather that rebuilds h happens here (ctx.seq.unstash_inputs), not in B: only
    dW = h.T @ dy reads it, so B, which the previous stage waits for, runs no gather for it, and from B to W
    the stash holds this rank's (B, T/t, C) piece rather than the whole (B, T, C). The gather is a tp
    collective: every tp rank runs its W halves in the same order (the ranks of a stage run one schedule).
    dys must reach W as B was handed them (unmodified)."""
    caches = ctx.seq.unstash_inputs(stash)
    with ctx.num.converted(xp, caches[0][0]):
        for dy, c, gw, gb in zip(dys, caches, gws, gbs or (None,) * len(gws)):
            linear_backward_weight(xp, dy, c, gw, gb, ctx.num)


def column_forward(xp, ctx, x, w, b=None, num=None):
    # x: (B, T_local, C), w: (C, OC / tp) -> y: (B, T, OC / tp), stash; num as columns_forward's nums
    (y,), stash = columns_forward(xp, ctx, x, (w,), None if b is None else (b,), () if num is None else (num,))
    return y, stash


def column_backward(xp, ctx, dy, stash, w, gw, gb=None, defer=None):
    # dy: (B, T, OC / tp) -> dx: (B, T_local, C)
    return columns_backward(xp, ctx, (dy,), stash, (w,), (gw,), None if gb is None else (gb,), defer)


def column_backward_input(xp, ctx, dy, stash, w):
    # dy: (B, T, OC / tp) -> dx: (B, T_local, C)
    return columns_backward_input(xp, ctx, (dy,), stash, (w,))


def column_backward_weight(xp, ctx, dy, stash, gw, gb=None):
    # dy: (B, T, OC / tp) -> None; accumulates gw (C, OC / tp) and gb
    columns_backward_weight(xp, ctx, (dy,), stash, (gw,), None if gb is None else (gb,))


def row_forward(xp, ctx, x, w, b=None):
    # x: (B, T, IC / tp), w: (IC / tp, C) -> y: (B, T_local, C), the linear's cache
    y, c = linear_forward(xp, x, w, num=ctx.num.float32_out)   # a partial sum: reduced and added in float32
    y = ctx.tp.reduce_from_tp(y)
    if b is not None:       # added once, after the partial sums are reduced
        y += b
    return y, c


def row_backward(xp, ctx, dy, cache, w, gw, gb=None, defer=None):
    # dy: (B, T_local, C) -> dx: (B, T, IC / tp)
    if defer is not None:
        dx, dy_full = row_backward_input(xp, ctx, dy, cache, w, gb)
        weight_grad(defer, row_backward_weight, xp, ctx, dy_full, cache, gw, held=(dy_full, cache))
        return dx
    if gb is not None:      # from this rank's positions: sequence parallelism sums it over tp later
        gb += dy.reshape(-1, dy.shape[-1]).sum(axis=0)
    return linear_backward(xp, ctx.tp.reduce_from_tp_backward(dy), cache, w, gw, num=ctx.num)


def row_backward_input(xp, ctx, dy, cache, w, gb=None):
    # dy: (B, T_local, C) -> (dx: (B, T, IC / tp), dy_full: (B, T, C), what row_backward_weight takes)
    """The input half (B) of row_backward: dx, and the bias gradient. The cache may lack its input
    (linear_drop_input): dx reads none, so a rebuilt input (gelu_recompute, swiglu_recompute) can wait for W.

    dy_full is dy as the row linear sees it, reduce_from_tp_backward(dy): under sequence parallelism the
    all-gather both halves need, run once, here; otherwise dy itself, which the caller must then leave
    unmodified until W runs (models/gpt.py writes into the gradient it hands the attention projection).
    gb is summed here, from this rank's positions of dy, as row_backward does (sequence parallelism sums
    it over tp later): W holds only the gathered dy_full, and one column sum is cheap.
    """
    if gb is not None:      # from this rank's positions: sequence parallelism sums it over tp later
        gb += dy.reshape(-1, dy.shape[-1]).sum(axis=0)
    dy_full = ctx.tp.reduce_from_tp_backward(dy)
    return linear_backward_input(xp, dy_full, cache, w, ctx.num), dy_full


def row_backward_weight(xp, ctx, dy_full, cache, gw):
    # dy_full: (B, T, C) from row_backward_input -> None; gw (IC / tp, C) += x.T @ dy_full
    """The weight half (W) of row_backward; the cache must hold its input again (linear_restore_input).
    Of ctx only the precision is read (the gather ran in B)."""
    linear_backward_weight(xp, dy_full, cache, gw, num=ctx.num)


def vocab_embed_forward(xp, ctx, idx, w):
    # idx: (B, T) global ids, w: (V / tp, C) -> (B, T_local, C); the sum over tp restores the full rows
    e, cache = embedding_forward(xp, idx, w, vocab_start=ctx.tp.rank * w.shape[0])
    return ctx.tp.reduce_from_tp(e), cache


def vocab_embed_backward(xp, ctx, dx, cache, gw, defer=None):
    # dx: (B, T_local, C) -> None; scatters into gw (V / tp, C): all of it weight gradient (W)
    weight_grad(defer, _vocab_embed_weight, xp, ctx, dx, cache, gw, held=(dx, cache))


def _vocab_embed_weight(xp, ctx, dx, cache, gw):
    embedding_backward(xp, ctx.tp.reduce_from_tp_backward(dx), cache, gw)


def vocab_loss_forward(xp, ctx, h, w, targets, norm, mask=None):
    # h: (B, T_local, C), w: (C, V / tp), targets: (B, T) -> loss (this rank's share of the global mean); mask:
    # (B, T), 0 where a target does not count (None: the packed documents' loss mask, if any)
    logits, c_lin = column_forward(xp, ctx, h, w)
    if logits.dtype.itemsize < 4:      # amp: the softmax and loss in float32, as Megatron does
        logits = logits.astype(xp.float32)
    if mask is None:       # packed documents: no loss across a boundary
        mask = None if ctx.docs is None else ctx.docs.loss_mask
    loss, c_ce = ctx.tp.cross_entropy_forward(xp, logits, targets, norm, mask)
    return loss, (c_lin, c_ce)


def vocab_loss_backward(xp, ctx, cache, w, gw, dloss=1.0, defer=None):
    # -> dh: (B, T_local, C); dloss is the amp loss scale
    c_lin, c_ce = cache
    dlogits = ctx.tp.cross_entropy_backward(xp, c_ce, dloss)
    if dlogits.dtype != gw.dtype:
        dlogits = dlogits.astype(gw.dtype)
    return column_backward(xp, ctx, dlogits, c_lin, w, gw, defer=defer)
