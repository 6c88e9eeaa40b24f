"""A small residual MLP over token embeddings (no attention): the fast model for tests.

Same block interface as GPT: "embed", "h.0" .. "h.{L-1}" (x + MLP(LayerNorm(x))), "head".
"""
from __future__ import annotations

import math

from hpengine.models.common import (
    Block,
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
from hpengine.models.context import LOCAL
from hpengine.models.decode import output_logits
from hpengine.models.interface import Capabilities
from hpengine.nn import (
    gelu_cache_elements,
    layernorm_backward,
    layernorm_cache_elements,
    layernorm_forward,
)
from hpengine.params.buffers import ParamSpec


class MLP:
    moe = None          # dense: no MoE component

    @staticmethod
    def capabilities(mcfg) -> Capabilities:
        """Per-position MLP blocks: no attention (nothing mixes positions), no experts."""
        return Capabilities(attention=False, qk_width=0, v_width=0)

    def __init__(self, mcfg, tp_size: int = 1):
        self.cfg = mcfg
        self.Vp = padded_vocab(mcfg.vocab_size, tp_size)
        self.V, self.C, self.L = mcfg.vocab_size, mcfg.d_model, mcfg.n_layers
        self.F, self.tied, self.std = mcfg.ffn_mult * mcfg.d_model, mcfg.tie_head, mcfg.init_std
        self.n_layers = self.L

    def blocks(self) -> list[Block]:
        return standard_blocks(self.L, self.tied)

    def tp_divides(self, tp: int) -> str:
        """What a tensor-parallel degree must divide ("" when it does)."""
        if self.F % tp or self.C % tp:
            return f"the ffn width ffn_mult x d_model = {self.F} and model.d_model = {self.C}"
        return ""

    def cache_bytes(self, rows: int, tp: int, item: int, amp: bool, share: int, parts: int = 1, cp: int = 1,
                    cp_comm: str = "ring") -> dict:
        """Bytes the forward caches per micro-batch of `rows` sequences, by block kind ("input": what a
        recomputed layer keeps). A layer: its layernorm, the fc linear's input and the GELU; no attention
        probabilities ("scores": 0), so selective recompute keeps the whole cache. parts: sequence pieces
        (sequence parallelism splits the layernorm and the fc input). cp: always 1 (the kind mixes no positions)."""
        n, C = rows * self.cfg.seq_len, self.C
        layer = layernorm_cache_elements(n // parts, C) + n // parts * C + gelu_cache_elements(n * self.F // tp)
        w = n * (C + C // parts + 2 * self.F // tp) * item      # W stash: dy, g, dh, h (models/gpt.py)
        bits = n * (C // parts + self.F // tp)                 # of those, what only GEMMs read: h and g
        return {"layer": layer * item, "scores": 0, "w_layer": w, "bits_w_layer": bits, **end_cache_bytes(self.cfg, rows, tp, item, amp, share,
                                                                       parts=parts)}

    # the tensors only linear layers read (packed bf16 storage hands them to the GEMMs as bits: gemm_weight)
    GEMM_WEIGHTS = (".mlp.fc.w", ".mlp.proj.w", "lm_head.w")

    def gemm_weight(self, name: str) -> bool:
        return name.endswith(self.GEMM_WEIGHTS)

    def tp_allreduces(self) -> tuple:
        """Activation allreduces per layer under tensor parallelism: (forward, backward); the MLP's reduce_from_tp
        forward and copy_to_tp backward."""
        return (1, 1)

    def sp_regathers(self) -> int:
        """Region entries per layer whose linear gathers its input again in backward under sequence parallelism:
        the first linear keeps only this rank's piece of its input."""
        return 1

    def attention_flops(self, tokens: int, tp: int) -> int:
        return 0

    def attention_flops_text(self) -> tuple:
        """A step's attention FLOPs per token, forward and backward, over every layer (3 x attention_flops), and
        what the term counts."""
        return ("12 x L x T x H x hd", "12 L T H hd = attention scores and values (H x hd = d_model unless "
                "model.head_dim is set)")

    def decode_cache_elements(self) -> int:
        return 0

    def specs(self, block: str) -> list[ParamSpec]:
        C = self.C
        if block == "embed":
            return embed_specs(self.V, C, self.Vp)
        if block == "head":
            return head_specs(self.V, C, self.tied, self.Vp)
        return ([ParamSpec(f"{block}.ln.w", (C,), decay=False, init="ones", block=block),
                 ParamSpec(f"{block}.ln.b", (C,), decay=False, init="zeros", block=block)]
                + mlp_specs(f"{block}.mlp", C, self.F, self.std, self.std / math.sqrt(2 * self.L)))

    def all_specs(self) -> list[ParamSpec]:
        return [s for b in self.blocks() for s in self.specs(b.name)]

    def embed_forward(self, xp, P, idx, ctx):
        # idx: (B, T) -> x: (B, T, C)
        return tok_embed_forward(xp, P, idx, ctx)

    def embed_backward(self, xp, dx, cache, G, ctx, defer=None):
        # dx: (B, T, C) -> None
        tok_embed_backward(xp, dx, cache, G, ctx, defer)

    def layer_forward(self, xp, P, i, x, ctx, keep_scores=True, loss=None):
        # x: (B, T, C) -> (B, T, C)
        # loss (norm, loss scale) is what an MoE layer of the llama kind reads; a dense layer adds no loss
        # no attention, so no scores to drop: selective recompute keeps this layer's cache whole
        p = f"h.{i}"
        h, c_ln = layernorm_forward(xp, x, P[f"{p}.ln.w"], P[f"{p}.ln.b"], num=ctx.num)
        m, c_mlp = mlp_forward(xp, P, f"{p}.mlp", h, ctx)
        return x + m, (c_ln, c_mlp)

    def layer_backward(self, xp, dy, cache, P, G, i, ctx, defer=None):
        # dy: (B, T, C) -> dx: (B, T, C); defer: a list for the weight-gradient products (nn/deferred.py)
        p = f"h.{i}"
        c_ln, c_mlp = cache
        dh = mlp_backward(xp, dy, c_mlp, P, G, f"{p}.mlp", ctx, defer)
        return dy + layernorm_backward(xp, dh, c_ln, P[f"{p}.ln.w"], G[f"{p}.ln.w"], G[f"{p}.ln.b"])

    def qk_columns(self, i: int, tp: int) -> tuple[tuple, int]:
        """No attention: no query or key weights for MuonClip to scale."""
        return (), 1

    def layer_stats(self, i, cache):
        """A dense layer adds nothing to the loss (the llama kind's MoE layers do: models/moe_mlp.py)."""
        return None

    def head_forward(self, xp, P, x, targets, norm, ctx):
        return head_forward(xp, P, x, targets, norm, ctx, self.tied)

    def head_backward(self, xp, cache, G, ctx, P, dloss=1.0, defer=None):
        return head_backward(xp, cache, G, ctx, self.tied, P, dloss, defer)

    # --- incremental decoding (models/decode.py): no layer mixes positions, so nothing is cached -----
    def decode_cache(self, xp, dtype):
        return [None] * self.L

    def decode_embed(self, xp, P, ids, start):
        return P["wte"][ids]

    def decode_layer(self, xp, P, i, x, cache, start):
        return self.layer_forward(xp, P, i, x, LOCAL)[0]

    def head_logits(self, xp, P, x):
        h, _ = layernorm_forward(xp, x, P["ln_f.w"], P["ln_f.b"])
        return output_logits(xp, P, h, self.tied, self.V)
