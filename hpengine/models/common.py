"""What models share: the structure they declare (Block), the pieces every model has (token embedding,
final layernorm + head + loss, and their cache sizes) and the MLP sub-block.
Parallelism reaches a model only through the context its blocks are handed (models/context.py); the
tensor-parallel linears the pieces here are built from are models/tp_layers.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from hpengine.models.tp_layers import (
    column_backward,
    column_forward,
    row_backward,
    row_forward,
    vocab_embed_backward,
    vocab_embed_forward,
    vocab_loss_backward,
    vocab_loss_forward,
)
from hpengine.nn import (
    OFF,
    embedding_cache_bytes,
    gelu_backward,
    gelu_forward,
    gelu_recompute,
    layernorm_backward,
    layernorm_cache_elements,
    layernorm_forward,
    linear_drop_input,
    linear_restore_input,
)
from hpengine.params.buffers import ParamSpec

__all__ = ["Block", "padded_vocab"]


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


def end_cache_bytes(mcfg, rows: int, tp: int, item: int, amp: bool, share: int, norm_bytes=None, parts: int = 1,
                    cp: int = 1) -> dict:
    """Bytes the embedding and the head cache per micro-batch of `rows` sequences: the embedding its
    indices; the head its final norm (`norm_bytes`; default a layernorm's), the linear's input (the norm's
    output), the loss's probabilities (float32 under amp) and the targets (its own index and mask under tp;
    else it references the pass's int64 targets, `share` sequences). Sequence parallelism (`parts` pieces)
    splits the norm, the linear's input and a recomputed layer's input; `norm_bytes` is then per piece.

    "w_embed", "w_head": the W stash of a split backward (nn/deferred.py), what a block's deferred
    weight-gradient work holds from B to W: the embedding its input gradient and indices, the head the
    logits' gradient (in the gradients' dtype, which is the activations') and the linear's input. Under
    context parallelism (degree cp) a rank holds T / cp tokens of each sequence.

    "bits_head", "bits_w_head": the elements of those that packed bf16 storage keeps as bfloat16 bits
    (planner/memory.block_activations): the linear's input, and in the cache the norm's normalised input."""
    T, C = mcfg.seq_len // cp, mcfg.d_model
    n, Vp = rows * T, padded_vocab(mcfg.vocab_size, tp)
    targets = embedding_cache_bytes(n) if tp > 1 else share * T * 8
    norm = layernorm_cache_elements(n // parts, C) * item if norm_bytes is None else norm_bytes
    head = norm + n // parts * C * item + n * (Vp // tp) * (4 if amp else item) + targets
    return {"embed": embedding_cache_bytes(n), "head": head, "input": n // parts * C * item,
            "w_embed": n // parts * C * item + embedding_cache_bytes(n),
            "w_head": (n * (Vp // tp) + n // parts * C) * item, "bits_head": 2 * n // parts * C,
            "bits_w_head": n // parts * C}


def tok_embed_forward(xp, P, idx, ctx):
    # idx: (B, T) -> (B, T, C); each tp rank looks up its vocab slice, the sum restores full rows
    return vocab_embed_forward(xp, ctx, idx, P["wte"])


def tok_embed_backward(xp, dx, cache, G, ctx, defer=None):
    # dx: (B, T, C) -> None (scatters into G["wte"])
    vocab_embed_backward(xp, ctx, dx, cache, G["wte"], defer)


def head_weight(P, G, tied):
    if tied:
        return P["wte"].T, (G["wte"].T if G is not None else None)
    return P["lm_head.w"], (G["lm_head.w"] if G is not None else None)


def head_forward(xp, P, x, targets, norm, ctx, tied):
    # x: (B, T, C) -> loss (this rank's share of the global-mean loss)
    h, c_ln = layernorm_forward(xp, x, P["ln_f.w"], P["ln_f.b"], num=ctx.num)
    loss, c = logits_loss_forward(xp, P, h, targets, norm, ctx, tied)
    return loss, (c_ln, c)


def head_backward(xp, cache, G, ctx, tied, P, dloss=1.0, defer=None):
    # -> dx: (B, T, C)
    c_ln, c = cache
    dh = logits_loss_backward(xp, c, G, ctx, tied, P, dloss, defer)
    return layernorm_backward(xp, dh, c_ln, P["ln_f.w"], G["ln_f.w"], G["ln_f.b"])


def logits_loss_forward(xp, P, h, targets, norm, ctx, tied):
    # the head after its norm: h (B, T, C) -> logits -> loss
    w, _ = head_weight(P, None, tied)
    return vocab_loss_forward(xp, ctx, h, w, targets, norm)


def logits_loss_backward(xp, cache, G, ctx, tied, P, dloss=1.0, defer=None):
    # -> dh: (B, T, C); dloss = the amp loss scale
    w, dw = head_weight(P, G, tied)
    return vocab_loss_backward(xp, ctx, cache, w, dw, dloss, defer)


def mlp_forward(xp, P, p, x, ctx):
    # x: (B, T, C) -> (B, T, C), the residual branch only
    h, c1 = column_forward(xp, ctx, x, P[f"{p}.fc.w"], P[f"{p}.fc.b"], ctx.num)    # bf16 amp: GELU reads bf16
    g, c2 = gelu_forward(xp, h, ctx.num)
    o, c3 = row_forward(xp, ctx, g, P[f"{p}.proj.w"], P[f"{p}.proj.b"])
    # g is rebuilt in backward from the GELU cache (one multiply): a third less MLP activation memory
    return o, (c1, c2, linear_drop_input(c3))


def mlp_backward(xp, do, cache, P, G, p, ctx, defer=None):
    # do: (B, T, C) -> dx: (B, T, C); `do` must stay unmodified until a deferred W runs
    stash, c2, c3 = cache
    c3 = linear_restore_input(c3, gelu_recompute(xp, c2, ctx.num))
    dg = row_backward(xp, ctx, do, c3, P[f"{p}.proj.w"], G[f"{p}.proj.w"], G[f"{p}.proj.b"], defer)
    del c3
    dh = gelu_backward(xp, dg, c2, ctx.num)       # bf16 amp: only the fc's GEMMs and bias gradient read it
    return column_backward(xp, ctx, dh, stash, P[f"{p}.fc.w"], G[f"{p}.fc.w"], G[f"{p}.fc.b"], defer)


def document_positions(ctx):
    """Each token's position within its document, (B, T), when the micro-batch packs documents; else None."""
    return None if ctx.docs is None else ctx.docs.positions


def document_cores(forward, backward, drop, restore, keep_scores: bool, ctx):
    """attention_cores handed ctx's precision and, when the micro-batch packs documents, their segments (every
    core and the probabilities' restore take them: a query sees only its own document)."""
    seg = None if ctx.docs is None else ctx.docs.segments
    if seg is not None:
        forward, backward = (functools.partial(f, segments=seg) for f in (forward, backward))
        restore = None if restore is None else functools.partial(restore, segments=seg)
    return attention_cores(forward, backward, drop, restore, keep_scores, ctx.num)


def attention_cores(forward, backward, drop, restore, keep_scores: bool, num=OFF):
    """A local attention core pair as the context's attention part takes it: forward(xp, *inputs) -> (y,
    cache), backward(xp, dy, cache), each handed the precision policy num. With keep_scores False (selective
    recompute) forward's cache drops the probabilities (drop) and backward rebuilds them first (restore, a
    no-op on a whole cache); None for drop and restore when the core keeps none (flash)."""
    if restore is None:
        return functools.partial(forward, num=num), functools.partial(backward, num=num)
    bwd = lambda xp, dy, cache: backward(xp, dy, restore(xp, cache, num=num), num=num)  # noqa: E731
    if keep_scores:
        return functools.partial(forward, num=num), bwd

    def fwd(xp, *inputs):
        y, cache = forward(xp, *inputs, num=num)
        return y, drop(cache)
    return fwd, bwd
