"""Pre-LayerNorm GPT-2 style decoder: parameter specs and the forward/backward of its blocks.

Blocks are "embed" (token + position embedding), "h.0" .. "h.{L-1}" (attention + MLP) and "head"
(final layernorm, output projection — tied to the token embedding or not — and the loss).
"""
from __future__ import annotations

import functools
import math

from hpengine.models.common import (
    Block,
    document_cores,
    document_positions,
    embed_specs,
    end_cache_bytes,
    head_backward,
    head_forward,
    head_specs,
    mlp_backward,
    mlp_forward,
    mlp_specs,
    padded_vocab,
    standard_blocks,
    tok_embed_backward,
    tok_embed_forward,
)
from hpengine.models.attention_logits import QKColumns
from hpengine.models.context import LOCAL
from hpengine.models.decode import KVCache, output_logits
from hpengine.models.interface import Capabilities
from hpengine.models.tp_layers import (
    column_backward,
    column_forward,
    row_backward,
    row_forward,
)
from hpengine.nn import (
    attention_backward,
    attention_cache_elements,
    attention_drop_scores,
    attention_forward,
    attention_restore_scores,
    gelu_cache_elements,
    layernorm_backward,
    layernorm_cache_elements,
    layernorm_forward,
    linear_forward,
    score_elements,
    weight_grad,
)
from hpengine.nn.ring_attention import context_cache_bytes
from hpengine.nn.flash import (
    flash_attention_backward,
    flash_attention_forward,
    flash_cache_bytes,
)
from hpengine.params.buffers import ParamSpec


def _position_grad(gw, positions, dx):
    gw[positions] += dx.sum(axis=0)


def _row_position_grad(xp, gw, positions, dx):
    # positions (B, n), each row's own (packed documents): a position repeats, so its rows add up one by one
    xp.add.at(gw, positions.reshape(-1), dx.reshape(-1, dx.shape[-1]))


class GPT:
    moe = None          # dense: no MoE component

    @staticmethod
    def capabilities(mcfg) -> Capabilities:
        """Causal attention over d_model / n_heads wide heads; no experts."""
        w = mcfg.d_model // mcfg.n_heads
        return Capabilities(attention=True, qk_width=w, v_width=w, kv_heads=mcfg.n_heads)

    def __init__(self, mcfg, tp_size: int = 1):
        self.cfg = mcfg
        self.Vp = padded_vocab(mcfg.vocab_size, tp_size)
        self.V, self.T, self.C = mcfg.vocab_size, mcfg.seq_len, mcfg.d_model
        self.L, self.H, self.F = mcfg.n_layers, mcfg.n_heads, mcfg.ffn_mult * mcfg.d_model
        self.tied = mcfg.tie_head
        self.std = mcfg.init_std
        self.n_layers = self.L
        self.flash = getattr(mcfg, "attention", "standard") == "flash"

    def blocks(self) -> list[Block]:
        return standard_blocks(self.L, self.tied)

    def tp_divides(self, tp: int) -> str:
        """What a tensor-parallel degree must divide ("" when it does)."""
        mc = self.cfg
        if self.H % tp or self.F % tp or self.C % tp:
            return (f"model.n_heads = {self.H}, the ffn width ffn_mult x d_model = {self.F} and model.d_model = "
                    f"{self.C}" + (f" (and cannot exceed the {mc.n_heads} heads)" if tp > mc.n_heads else ""))
        return ""

    def cache_bytes(self, rows: int, tp: int, item: int, amp: bool, share: int, parts: int = 1, cp: int = 1,
                    cp_comm: str = "ring") -> dict:
        """Bytes the forward caches per micro-batch of `rows` sequences, by block kind ("input": what a
        recomputed layer keeps). A layer: ln1, the qkv linear's input (ln1's output), attention (its
        output is the projection's input), ln2, the fc linear's input and the GELU (the projection's input
        is rebuilt from it). model.attention = "flash" keeps no T x T probabilities: qkv, the output and
        one log-sum-exp per row and head. "scores": the probabilities' part of "layer", which selective
        recompute drops (0 under flash). parts: pieces of the sequence under sequence parallelism, which
        split the layernorms' caches, the linear inputs and a recomputed layer's input. cp: context parallel
        degree; a rank holds T / cp tokens of each sequence and its attention is the cp_comm driver's
        (flash-style: no probabilities, whatever model.attention says)."""
        T, C, H = self.T // cp, self.C, self.H // tp
        n = rows * T
        ns = n // parts
        if cp > 1:
            att = context_cache_bytes(rows, T, H, H, C // self.H, item, cp, cp_comm)
        else:
            att = (flash_cache_bytes(rows, T, H, H, C // self.H, item) if self.flash
                   else attention_cache_elements(rows, T, C // tp, H) * item)
        layer = (2 * layernorm_cache_elements(ns, C) + 2 * ns * C + gelu_cache_elements(n * self.F // tp)) * item + att
        scores = 0 if self.flash or cp > 1 else rows * H * score_elements(T) * item
        # W stash (split backward): each row linear's whole output gradient and input, each column linear's
        # output gradient and input (a piece of it under sequence parallelism): dy, g, dh, h2; dx1, a, dqkv, h
        w = n * (2 * C + 2 * C // parts + (2 * self.F + 4 * C) // tp) * item
        # of those, what only GEMMs read: h2, h, g, dh (GELU's gradient) and, with the attention on this rank, a
        # (and dqkv under flash, whose gradients are bits)
        a_bits = (C + (3 * C if self.flash else 0)) // tp if cp == 1 else 0
        bits = n * (2 * C // parts + 2 * self.F // tp + a_bits)
        return {"layer": layer, "scores": scores, "w_layer": w, "bits_w_layer": bits,
                **end_cache_bytes(self.cfg, rows, tp, item, amp, share, parts=parts, cp=cp)}

    # the tensors only linear layers read (packed bf16 storage hands them to the GEMMs as bits: gemm_weight)
    GEMM_WEIGHTS = (".attn.qkv.w", ".attn.proj.w", ".mlp.fc.w", ".mlp.proj.w", "lm_head.w")

    def gemm_weight(self, name: str) -> bool:
        return name.endswith(self.GEMM_WEIGHTS)

    def tp_allreduces(self) -> tuple:
        """Activation allreduces per layer under tensor parallelism: (forward, backward); the attention's and the MLP's reduce_from_tp
        forward and copy_to_tp backward."""
        return (2, 2)

    def sp_regathers(self) -> int:
        """Region entries per layer whose linear gathers its input again in backward under sequence parallelism:
        the attention's and the MLP's first linears keep only this rank's piece of their input."""
        return 2

    def attention_flops(self, tokens: int, tp: int) -> int:
        """Forward FLOPs of one layer's scores and their product with the values (2 T C / tp per token each)."""
        return 4 * tokens * self.T * self.C // tp

    def attention_flops_text(self) -> tuple:
        """A step's attention FLOPs per token, forward and backward, over every layer (3 x attention_flops), and
        what the term counts."""
        return ("12 x L x T x H x hd", "12 L T H hd = attention scores and values (H x hd = d_model unless "
                "model.head_dim is set)")

    def decode_cache_elements(self) -> int:
        """Every layer's key and value (d_model each) per token: decode_cache's KVCache."""
        return 2 * self.L * self.C

    def specs(self, block: str) -> list[ParamSpec]:
        C, std = self.C, self.std
        if block == "embed":
            return embed_specs(self.V, C, self.Vp) + [ParamSpec("wpe", (self.T, C), block="embed")]
        if block == "head":
            return head_specs(self.V, C, self.tied, self.Vp)
        p, proj_std = block, std / math.sqrt(2 * self.L)  # GPT-2: residual projections scaled down
        ln = lambda n: [ParamSpec(f"{p}.{n}.w", (C,), decay=False, init="ones", block=p),  # noqa: E731
                        ParamSpec(f"{p}.{n}.b", (C,), decay=False, init="zeros", block=p)]
        return (ln("ln1")
                + [ParamSpec(f"{p}.attn.qkv.w", (C, 3 * C), tp_dim=1, std=std, block=p),
                   ParamSpec(f"{p}.attn.qkv.b", (3 * C,), tp_dim=0, decay=False, init="zeros", block=p),
                   ParamSpec(f"{p}.attn.proj.w", (C, C), tp_dim=0, std=proj_std, block=p),
                   ParamSpec(f"{p}.attn.proj.b", (C,), decay=False, init="zeros", block=p)]
                + ln("ln2") + mlp_specs(f"{p}.mlp", C, self.F, std, proj_std))

    def all_specs(self) -> list[ParamSpec]:
        return [s for b in self.blocks() for s in self.specs(b.name)]

    def _cores(self, ctx, keep_scores=True):
        """The local attention core pair (fused qkv, or flash) handed ctx's precision and documents, dropping the
        probabilities when asked."""
        if self.flash:
            return document_cores(flash_attention_forward, flash_attention_backward, None, None, keep_scores, ctx)
        return document_cores(attention_forward, attention_backward, attention_drop_scores, attention_restore_scores,
                              keep_scores, ctx)

    # --- blocks -------------------------------------------------------------------------------
    def embed_forward(self, xp, P, idx, ctx):
        # idx: (B, T) -> x: (B, T, C)
        x, cache = tok_embed_forward(xp, P, idx, ctx)
        x += P["wpe"][self._positions(ctx, x.shape[1])]     # this rank's positions under sequence parallelism
        return x, cache

    def _positions(self, ctx, n):
        """The positions of this rank's n tokens of each sequence: a slice, or (packed documents) each row's own."""
        pos = document_positions(ctx)
        return ctx.seq.local_positions(n) if pos is None else pos[:, ctx.seq.local_columns(n)]

    def embed_backward(self, xp, dx, cache, G, ctx, defer=None):
        # dx: (B, T, C) -> None: all weight gradient
        pos = self._positions(ctx, dx.shape[1])
        if document_positions(ctx) is None:
            weight_grad(defer, _position_grad, G["wpe"], pos, dx, held=(dx,))
        else:
            weight_grad(defer, functools.partial(_row_position_grad, xp), G["wpe"], pos, dx, held=(dx,))
        tok_embed_backward(xp, dx, cache, G, ctx, defer)

    def layer_forward(self, xp, P, i, x, ctx, keep_scores=True, loss=None):
        # x: (B, T, C) -> (B, T, C)
        # loss (norm, loss scale) is what an MoE layer of the llama kind reads; a dense layer adds no loss
        # keep_scores=False (selective recompute): the cache drops the attention probabilities, which
        # layer_backward rebuilds; flash attention keeps none anyway
        p = f"h.{i}"
        h, c_ln1 = layernorm_forward(xp, x, P[f"{p}.ln1.w"], P[f"{p}.ln1.b"], num=ctx.num)
        qkv, c_qkv = column_forward(xp, ctx, h, P[f"{p}.attn.qkv.w"], P[f"{p}.attn.qkv.b"], self._attention_num(ctx))
        qkv, _ = ctx.attn.kv_forward(qkv, None)          # the fused core reads its keys and values from qkv
        sink = None if loss is None else ctx.logits.sink(i)     # MuonClip: the training forwards' largest logits
        a, c_att = ctx.attn.fused_forward(xp, self._cores(ctx, keep_scores)[0], qkv, self.H // ctx.tp.size, sink)
        o, c_proj = row_forward(xp, ctx, a, P[f"{p}.attn.proj.w"], P[f"{p}.attn.proj.b"])
        o += x                  # o is ours: the residual sum needs no new array
        x1 = o
        h2, c_ln2 = layernorm_forward(xp, x1, P[f"{p}.ln2.w"], P[f"{p}.ln2.b"], num=ctx.num)
        m, c_mlp = mlp_forward(xp, P, f"{p}.mlp", h2, ctx)
        x1 += m
        return x1, (c_ln1, c_qkv, c_att, c_proj, c_ln2, c_mlp)

    def _attention_num(self, ctx):
        """The policy of the attention's input: under bf16 amp flash attention on this rank reads qkv as bfloat16
        (bits when packed), as the tensor-core kernels take it; the fused standard core and context
        parallelism's drivers read float32."""
        return ctx.num if self.flash and ctx.attn.local_core else ctx.num.float32_out

    def layer_backward(self, xp, dy, cache, P, G, i, ctx, defer=None):
        # dy: (B, T, C) -> dx: (B, T, C); defer: a list for the weight-gradient products (nn/deferred.py),
        # which read dy and the gradients below as made here: none of them is written after it is made
        p = f"h.{i}"
        c_ln1, c_qkv, c_att, c_proj, c_ln2, c_mlp = cache
        dh2 = mlp_backward(xp, dy, c_mlp, P, G, f"{p}.mlp", ctx, defer)
        dx1 = layernorm_backward(xp, dh2, c_ln2, P[f"{p}.ln2.w"], G[f"{p}.ln2.w"], G[f"{p}.ln2.b"])
        dx1 += dy
        da = row_backward(xp, ctx, dx1, c_proj, P[f"{p}.attn.proj.w"], G[f"{p}.attn.proj.w"], G[f"{p}.attn.proj.b"],
                          defer)
        dqkv = ctx.attn.fused_backward(xp, self._cores(ctx)[1], da, c_att)
        dqkv, _ = ctx.attn.kv_backward(dqkv, None)
        dh = column_backward(xp, ctx, dqkv, c_qkv, P[f"{p}.attn.qkv.w"], G[f"{p}.attn.qkv.w"], G[f"{p}.attn.qkv.b"],
                             defer)
        dx = layernorm_backward(xp, dh, c_ln1, P[f"{p}.ln1.w"], G[f"{p}.ln1.w"], G[f"{p}.ln1.b"])
        dx += dx1           # into the new array: a deferred W still reads dx1 (a + b is b + a, bit for bit)
        return dx

    def qk_columns(self, i: int, tp: int) -> tuple[tuple[QKColumns, ...], int]:
        """Where layer i's query and key columns of each of a tp rank's heads sit (weight and bias of the fused,
        head-major qkv: [h][q, k, v][d]), and the query heads per key head (1)."""
        hd, p = self.C // self.H, f"h.{i}.attn.qkv"
        return tuple(QKColumns(f"{p}.{t}", r, o, 3 * hd, hd) for t in "wb" for r, o in (("q", 0), ("k", hd))), 1

    def layer_stats(self, i, cache):
        """A dense layer adds nothing to the loss (the llama kind's MoE layers do: models/moe_mlp.py)."""
        return None

    def head_forward(self, xp, P, x, targets, norm, ctx):
        return head_forward(xp, P, x, targets, norm, ctx, self.tied)

    def head_backward(self, xp, cache, G, ctx, P, dloss=1.0, defer=None):
        return head_backward(xp, cache, G, ctx, self.tied, P, dloss, defer)

    # --- incremental decoding (models/decode.py) ------------------------------------------------
    def decode_cache(self, xp, dtype):
        return [KVCache(xp, self.H, self.T, self.C // self.H, dtype) for _ in range(self.L)]

    def decode_embed(self, xp, P, ids, start):
        return P["wte"][ids] + P["wpe"][start:start + ids.shape[1]]

    def decode_layer(self, xp, P, i, x, cache, start):
        p, n, H = f"h.{i}", x.shape[1], self.H
        hd = self.C // H
        h, _ = layernorm_forward(xp, x, P[f"{p}.ln1.w"], P[f"{p}.ln1.b"])
        qkv, _ = linear_forward(xp, h, P[f"{p}.attn.qkv.w"], P[f"{p}.attn.qkv.b"])
        qkv = qkv[0].reshape(n, H, 3, hd).transpose(2, 1, 0, 3)         # head-major columns [h][q,k,v][d]
        a = cache.attend(xp, qkv[0][:, None] * (1.0 / math.sqrt(hd)), qkv[1], qkv[2], start)
        a = a[:, 0].transpose(1, 0, 2).reshape(1, n, H * hd)
        o, _ = linear_forward(xp, xp.ascontiguousarray(a), P[f"{p}.attn.proj.w"])
        o += P[f"{p}.attn.proj.b"]
        o += x
        h2, _ = layernorm_forward(xp, o, P[f"{p}.ln2.w"], P[f"{p}.ln2.b"])
        m, _ = mlp_forward(xp, P, f"{p}.mlp", h2, LOCAL)
        return o + m

    def head_logits(self, xp, P, x):
        h, _ = layernorm_forward(xp, x, P["ln_f.w"], P["ln_f.b"])
        return output_logits(xp, P, h, self.tied, self.V)
