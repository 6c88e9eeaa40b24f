"""What models share: the tensor-parallel hooks a block is handed (identities for one rank), the
pieces every model has (token embedding, final layernorm + head + loss) and the MLP sub-block.

Tensor parallelism reaches a model only through a `tp` object like LocalTP; the real one lives in
strategies/tensor_parallel.py.
"""
from __future__ import annotations

from ..buffers import ParamSpec

__all__ = ["LocalTP", "padded_vocab"]
from ..nn import (cross_entropy_backward, cross_entropy_forward, embedding_backward,
                  embedding_forward, gelu_backward, gelu_forward, gelu_recompute, layernorm_backward,
                  layernorm_forward, linear_backward, linear_drop_input, linear_forward,
                  linear_restore_input)


class LocalTP:
    """Tensor-parallel hooks for tp = 1: every conjugate pair is the identity."""
    rank, size = 0, 1

    def copy_fwd(self, x):       # copy_to_tp: identity forward ...
        return x

    def copy_bwd(self, dx):      # ... allreduce backward
        return dx

    def reduce_fwd(self, x):     # reduce_from_tp: allreduce forward ...
        return x

    def reduce_bwd(self, dx):    # ... identity backward
        return dx

    def cross_entropy_forward(self, xp, logits, targets, norm):
        return cross_entropy_forward(xp, logits, targets, norm)

    def cross_entropy_backward(self, xp, cache, dloss=1.0):
        return cross_entropy_backward(xp, cache, dloss)


def padded_vocab(V, multiple):
    """The vocabulary rounded up so tensor parallelism splits it evenly."""
    return -(-V // multiple) * multiple


def embed_specs(V, C, Vp=None):
    Vp = Vp or V
    return [ParamSpec("wte", (Vp, C), tp_dim=0, decay=True, block="embed",
                      true_shape=(V, C) if Vp != V else None)]


def head_specs(V, C, tied, Vp=None):
    Vp = Vp or V
    specs = [ParamSpec("ln_f.w", (C,), decay=False, init="ones", block="head"),
             ParamSpec("ln_f.b", (C,), decay=False, init="zeros", block="head")]
    if not tied:
        specs.append(ParamSpec("lm_head.w", (C, Vp), tp_dim=1, block="head",
                               true_shape=(C, V) if Vp != V else None))
    return specs


def mlp_specs(p, C, F, std, proj_std):
    # column-split first linear, row-split second (Megatron); second bias added after the reduce
    return [ParamSpec(f"{p}.fc.w", (C, F), tp_dim=1, std=std, block=p.split(".mlp")[0]),
            ParamSpec(f"{p}.fc.b", (F,), tp_dim=0, decay=False, init="zeros", block=p.split(".mlp")[0]),
            ParamSpec(f"{p}.proj.w", (F, C), tp_dim=0, std=proj_std, block=p.split(".mlp")[0]),
            ParamSpec(f"{p}.proj.b", (C,), decay=False, init="zeros", block=p.split(".mlp")[0])]


def tok_embed_forward(xp, P, idx, tp):
    # idx: (B, T) -> (B, T, C); each tp rank looks up its vocab slice, the sum restores full rows
    w = P["wte"]
    e, cache = embedding_forward(xp, idx, w, vocab_start=tp.rank * w.shape[0])
    return tp.reduce_fwd(e), cache


def tok_embed_backward(xp, dx, cache, G, tp):
    embedding_backward(xp, tp.reduce_bwd(dx), cache, G["wte"])


def head_weight(P, G, tied):
    if tied:
        return P["wte"].T, (G["wte"].T if G is not None else None)
    return P["lm_head.w"], (G["lm_head.w"] if G is not None else None)


def head_forward(xp, P, x, targets, norm, tp, tied):
    # x: (B, T, C) -> loss (this rank's share of the global-mean loss)
    h, c_ln = layernorm_forward(xp, x, P["ln_f.w"], P["ln_f.b"])
    w, _ = head_weight(P, None, tied)
    logits, c_lin = linear_forward(xp, tp.copy_fwd(h), w)
    if logits.dtype.itemsize < 4:      # amp: the softmax and loss in float32, as Megatron does
        logits = logits.astype(xp.float32)
    loss, c_ce = tp.cross_entropy_forward(xp, logits, targets, norm)
    return loss, (c_ln, c_lin, c_ce)


def head_backward(xp, cache, G, tp, tied, P, dloss=1.0):
    c_ln, c_lin, c_ce = cache
    dlogits = tp.cross_entropy_backward(xp, c_ce, dloss)   # dloss = the amp loss scale
    w, dw = head_weight(P, G, tied)
    if dlogits.dtype != dw.dtype:
        dlogits = dlogits.astype(dw.dtype)
    dh = tp.copy_bwd(linear_backward(xp, dlogits, c_lin, w, dw))
    return layernorm_backward(xp, dh, c_ln, P["ln_f.w"], G["ln_f.w"], G["ln_f.b"])


def mlp_forward(xp, P, p, x, tp):
    # x: (B, T, C) -> (B, T, C), the residual branch only
    h, c1 = linear_forward(xp, tp.copy_fwd(x), P[f"{p}.fc.w"], P[f"{p}.fc.b"])
    g, c2 = gelu_forward(xp, h)
    o, c3 = linear_forward(xp, g, P[f"{p}.proj.w"])
    # g is rebuilt in backward from the GELU cache (one multiply): a third less MLP activation memory
    c3 = linear_drop_input(c3)
    o = tp.reduce_fwd(o)
    o += P[f"{p}.proj.b"]
    return o, (c1, c2, c3)


def mlp_backward(xp, do, cache, P, G, p, tp):
    c1, c2, c3 = cache
    G[f"{p}.proj.b"] += do.reshape(-1, do.shape[-1]).sum(axis=0)
    c3 = linear_restore_input(c3, gelu_recompute(xp, c2))
    dg = linear_backward(xp, tp.reduce_bwd(do), c3, P[f"{p}.proj.w"], G[f"{p}.proj.w"])
    del c3
    dh = gelu_backward(xp, dg, c2)
    return tp.copy_bwd(linear_backward(xp, dh, c1, P[f"{p}.fc.w"], G[f"{p}.fc.w"], G[f"{p}.fc.b"]))
