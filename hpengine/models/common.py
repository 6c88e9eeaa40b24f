"""What models share: the structure they declare (Block), the tensor-parallel hooks a block is handed
(identities for one rank), the pieces every model has (token embedding, final layernorm + head + loss,
and their cache sizes) and the MLP sub-block.

Tensor parallelism reaches a model only through a `tp` object like LocalTP; the real one lives in
strategies/tensor_parallel.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpengine.params.buffers import ParamSpec
from hpengine.nn import (cross_entropy_backward, cross_entropy_forward, embedding_backward, embedding_cache_bytes,
                  embedding_forward, gelu_backward, gelu_forward, gelu_recompute, layernorm_backward,
                  layernorm_cache_elements, layernorm_forward, linear_backward, linear_drop_input, linear_forward,
                  linear_restore_input)

__all__ = ["Block", "LocalTP", "padded_vocab"]


@dataclass(frozen=True)
class Block:
    """One unit of a model as the engine and planner see it: pipeline stages are cut from blocks, the
    gradient sync runs per block, stage 3 gathers per block.

    kind: "embed" (token ids in), "layer" (activations in and out), "head" (activations in, loss out).
    reads: tensors of other blocks this block multiplies by (a tied head reads "wte").
    bwd_params: whether its backward reads its parameters (an embedding's backward only scatters)."""
    name: str
    kind: str
    layer: int = -1
    reads: tuple = ()
    bwd_params: bool = True


def standard_blocks(n_layers: int, tied: bool) -> list[Block]:
    """embed, h.0 .. h.{L-1}, head: the structure of every decoder here."""
    return ([Block("embed", "embed", bwd_params=False)] + [Block(f"h.{i}", "layer", i) for i in range(n_layers)]
            + [Block("head", "head", reads=("wte",) if tied else ())])


class LocalTP:
    """Tensor-parallel hooks for tp = 1: every conjugate pair is the identity (strategies.TensorParallel and
    SequenceParallel subclass it and replace the halves that communicate)."""
    rank, size = 0, 1

    def copy_to_tp(self, x):                 # identity forward ...
        return x

    def copy_to_tp_backward(self, dx):       # ... allreduce backward
        return dx

    def reduce_from_tp(self, x):             # allreduce forward ...
        return x

    def reduce_from_tp_backward(self, dx):   # ... identity backward
        return dx

    # --- what sequence parallelism changes (strategies/sequence_parallel.py); neutral here ------
    seq_parts = 1                            # pieces the sequence is cut into between tp regions

    def local_positions(self, n: int) -> slice:
        """Positions of this rank's n tokens of each sequence."""
        return slice(0, n)

    def stash_inputs(self, x, *caches):
        """The linear caches of a region's entry, whose input is copy_to_tp(x), as the forward keeps them."""
        return caches

    def unstash_inputs(self, stash):
        return stash

    def sum_replicated_(self, g, ranges) -> None:
        """Gradients of tensors every tp rank holds whole: already equal on every rank."""

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


def end_cache_bytes(mcfg, rows: int, tp: int, item: int, amp: bool, share: int, norm_bytes=None, parts: int = 1) -> dict:
    """Bytes the embedding and the head cache per micro-batch of `rows` sequences: the embedding its
    indices; the head its final norm (`norm_bytes`; default a layernorm's), the linear's input (the norm's
    output), the loss's probabilities (float32 under amp) and the targets (its own index and mask under tp;
    else it references the pass's int64 targets, `share` sequences). Sequence parallelism (`parts` pieces)
    splits the norm, the linear's input and a recomputed layer's input; `norm_bytes` is then per piece."""
    T, C = mcfg.seq_len, mcfg.d_model
    n, Vp = rows * T, padded_vocab(mcfg.vocab_size, tp)
    targets = embedding_cache_bytes(n) if tp > 1 else share * T * 8
    norm = layernorm_cache_elements(n // parts, C) * item if norm_bytes is None else norm_bytes
    head = norm + n // parts * C * item + n * (Vp // tp) * (4 if amp else item) + targets
    return {"embed": embedding_cache_bytes(n), "head": head, "input": n // parts * C * item}


def tok_embed_forward(xp, P, idx, tp):
    # idx: (B, T) -> (B, T, C); each tp rank looks up its vocab slice, the sum restores full rows
    w = P["wte"]
    e, cache = embedding_forward(xp, idx, w, vocab_start=tp.rank * w.shape[0])
    return tp.reduce_from_tp(e), cache


def tok_embed_backward(xp, dx, cache, G, tp):
    embedding_backward(xp, tp.reduce_from_tp_backward(dx), cache, G["wte"])


def head_weight(P, G, tied):
    if tied:
        return P["wte"].T, (G["wte"].T if G is not None else None)
    return P["lm_head.w"], (G["lm_head.w"] if G is not None else None)


def head_forward(xp, P, x, targets, norm, tp, tied):
    # x: (B, T, C) -> loss (this rank's share of the global-mean loss)
    h, c_ln = layernorm_forward(xp, x, P["ln_f.w"], P["ln_f.b"])
    loss, c = logits_loss_forward(xp, P, h, targets, norm, tp, tied)
    return loss, (c_ln, c)


def head_backward(xp, cache, G, tp, tied, P, dloss=1.0):
    c_ln, c = cache
    dh = logits_loss_backward(xp, c, G, tp, tied, P, dloss)
    return layernorm_backward(xp, dh, c_ln, P["ln_f.w"], G["ln_f.w"], G["ln_f.b"])


def logits_loss_forward(xp, P, h, targets, norm, tp, tied):
    # the head after its norm: h (B, T, C) -> logits -> loss
    w, _ = head_weight(P, None, tied)
    logits, c_lin = linear_forward(xp, tp.copy_to_tp(h), w)
    c_lin = tp.stash_inputs(h, c_lin)
    if logits.dtype.itemsize < 4:      # amp: the softmax and loss in float32, as Megatron does
        logits = logits.astype(xp.float32)
    loss, c_ce = tp.cross_entropy_forward(xp, logits, targets, norm)
    return loss, (c_lin, c_ce)


def logits_loss_backward(xp, cache, G, tp, tied, P, dloss=1.0):
    (c_lin,), c_ce = tp.unstash_inputs(cache[0]), cache[1]
    dlogits = tp.cross_entropy_backward(xp, c_ce, dloss)   # dloss = the amp loss scale
    w, dw = head_weight(P, G, tied)
    if dlogits.dtype != dw.dtype:
        dlogits = dlogits.astype(dw.dtype)
    return tp.copy_to_tp_backward(linear_backward(xp, dlogits, c_lin, w, dw))


def mlp_forward(xp, P, p, x, tp):
    # x: (B, T, C) -> (B, T, C), the residual branch only
    h, c1 = linear_forward(xp, tp.copy_to_tp(x), P[f"{p}.fc.w"], P[f"{p}.fc.b"])
    c1 = tp.stash_inputs(x, c1)
    g, c2 = gelu_forward(xp, h)
    o, c3 = linear_forward(xp, g, P[f"{p}.proj.w"])
    # g is rebuilt in backward from the GELU cache (one multiply): a third less MLP activation memory
    c3 = linear_drop_input(c3)
    o = tp.reduce_from_tp(o)
    o += P[f"{p}.proj.b"]
    return o, (c1, c2, c3)


def mlp_backward(xp, do, cache, P, G, p, tp):
    stash, c2, c3 = cache
    G[f"{p}.proj.b"] += do.reshape(-1, do.shape[-1]).sum(axis=0)
    c3 = linear_restore_input(c3, gelu_recompute(xp, c2))
    dg = linear_backward(xp, tp.reduce_from_tp_backward(do), c3, P[f"{p}.proj.w"], G[f"{p}.proj.w"])
    del c3
    dh = gelu_backward(xp, dg, c2)
    (c1,) = tp.unstash_inputs(stash)
    return tp.copy_to_tp_backward(linear_backward(xp, dh, c1, P[f"{p}.fc.w"], G[f"{p}.fc.w"], G[f"{p}.fc.b"]))
