"""Llama-family decoder (the semantics of Hugging Face's LlamaForCausalLM): token embedding, pre-norm
blocks x + attn(rmsnorm(x)), x + mlp(rmsnorm(x)), a final RMSNorm and the head; no biases. Grouped-query
attention with rotary embedding (optional Qwen3 q/k norm), a SwiGLU MLP, parameters stored (in, out).
"""
from __future__ import annotations

import math

from hpengine.config.load import ffn_width, head_width
from hpengine.models.common import (
    Block,
    document_cores,
    document_positions,
    embed_specs,
    end_cache_bytes,
    logits_loss_backward,
    logits_loss_forward,
    padded_vocab,
    standard_blocks,
    tok_embed_backward,
    tok_embed_forward,
)
from hpengine.models.attention_logits import QKColumns
from hpengine.models.context import LOCAL
from hpengine.models.decode import KVCache, output_logits
from hpengine.models.interface import Capabilities
from hpengine.models.moe_mlp import MoEMLP
from hpengine.models.mtp import MTP
from hpengine.models.tp_layers import (
    columns_backward,
    columns_forward,
    row_backward,
    row_forward,
)
from hpengine.nn import (
    embedding_cache_bytes,
    gqa_attention_backward,
    gqa_attention_forward,
    gqa_cache_elements,
    gqa_drop_scores,
    gqa_restore_scores,
    linear_drop_input,
    linear_forward,
    linear_restore_input,
    rmsnorm_backward,
    rmsnorm_cache_bytes,
    rmsnorm_forward,
    rope_backward,
    rope_forward,
    rope_tables,
    score_elements,
    swiglu_backward,
    swiglu_cache_elements,
    swiglu_forward,
    swiglu_recompute,
)
from hpengine.nn.ring_attention import context_cache_bytes
from hpengine.nn.flash import flash_cache_bytes, flash_gqa_backward, flash_gqa_forward
from hpengine.params.buffers import ParamSpec


# Attention: n_heads query heads share n_kv_heads key/value heads (grouped-query), rotary embedding on q
# and k ("rotate half"), causal softmax scaled by 1/sqrt(head_dim); head_dim is model.head_dim, or d_model / n_heads
# when it is 0 (q is (C, H*hd), k and v (C, K*hd), o (H*hd, C)). With model.qk_norm (Qwen3) each head's q and k are
# RMS-normalised over head_dim, with learned (head_dim,) weights, before the rotation. MLP: down(silu(gate(x)) * up(x)).
#
# Parameters are stored (in, out) — Hugging Face's `*_proj.weight` transposed; q, k and v are separate
# matrices whose columns are head-major (head h owns columns h*hd .. (h+1)*hd - 1), in Hugging Face's
# rotary convention, so the export is a rename and a transpose. Under tensor parallelism q, k, v, gate and
# up split by columns (whole query and key/value heads per rank), o and down by rows, as Megatron does; the
# q/k norm weights are replicated, and each rank's gradient of them (its heads' part) is summed over tp.
class Llama:
    @staticmethod
    def capabilities(mcfg) -> Capabilities:
        """Grouped-query attention over model.head_dim wide heads; routed experts where model.moe has them."""
        w, e = head_width(mcfg), mcfg.moe
        return Capabilities(attention=True, qk_width=w, v_width=w, kv_heads=mcfg.n_kv_heads or mcfg.n_heads,
                            experts=e.num_experts,
                            capacity_factor=e.capacity_factor if e.num_experts else 0.0,
                            top_k=e.top_k if e.num_experts else 0, mtp_depth=mcfg.mtp.depth)

    def __init__(self, mcfg, tp_size: int = 1):
        self.cfg = mcfg
        self.Vp = padded_vocab(mcfg.vocab_size, tp_size)
        self.V, self.T, self.C, self.L = mcfg.vocab_size, mcfg.seq_len, mcfg.d_model, mcfg.n_layers
        self.H, self.K = mcfg.n_heads, mcfg.n_kv_heads or mcfg.n_heads
        self.hd, self.F = head_width(mcfg), ffn_width(mcfg)
        self.tied, self.std, self.eps = mcfg.tie_head, mcfg.init_std, mcfg.norm_eps
        self.n_layers = self.L
        self._tables = {}
        self.flash = getattr(mcfg, "attention", "standard") == "flash"
        self.qk = bool(getattr(mcfg, "qk_norm", False))
        self.moe = MoEMLP(mcfg, self.F) if mcfg.moe.num_experts else None
        self.mtp = MTP(self, mcfg) if mcfg.mtp.depth else None

    def _routed(self, i: int) -> bool:
        return self.moe is not None and self.moe.routed(i)

    def blocks(self) -> list[Block]:
        return standard_blocks(self.L, self.tied or self.mtp is not None)    # MTP embeds with the head

    def tp_divides(self, tp: int) -> str:
        """What a tensor-parallel degree must divide ("" when it does)."""
        if self.H % tp or self.K % tp or self.F % tp or self.C % tp:
            return (f"model.n_heads = {self.H}, the key/value heads n_kv_heads = {self.K}, the SwiGLU width "
                    f"{self.F} and model.d_model = {self.C} (each rank holds whole key/value heads, as in "
                    "Megatron; use a degree that divides n_kv_heads)")
        return self.moe.tp_divides(tp) if self.moe is not None else ""

    def cache_bytes(self, rows: int, tp: int, item: int, amp: bool, share: int, parts: int = 1, cp: int = 1,
                    cp_comm: str = "ring") -> dict:
        """Bytes the forward caches per micro-batch of `rows` sequences, by block kind ("input": what a
        recomputed layer keeps). A layer: two RMSNorms, the q/k/v linears' input and the gate/up linears'
        input (the norms' outputs), the attention (rotated q and k, v, probabilities, its output, which
        is the o linear's input) and the SiLU gating (the down linear's input is rebuilt from it); with
        qk_norm, the q and k norms' normalised heads and one 1/rms per head and position (whole sequences:
        they sit inside the tp region). model.attention = "flash" keeps one log-sum-exp per row and head in
        place of the probabilities.
        "scores": the probabilities' part of "layer", which selective recompute drops (0 under flash).
        parts: sequence pieces (sequence parallelism splits the norms and the linears' inputs). cp: context
        parallel degree; a rank holds T / cp tokens of each sequence and its attention is the cp_comm driver's
        (flash-style: no probabilities, whatever model.attention says)."""
        T, C, H, K = self.T // cp, self.C, self.H // tp, self.K // tp
        n = rows * T
        ns = n // parts
        if cp > 1:
            att = context_cache_bytes(rows, T, H, K, self.hd, item, cp, cp_comm)
        else:
            att = (flash_cache_bytes(rows, T, H, K, self.hd, item) if self.flash
                   else gqa_cache_elements(rows, T, H, K, self.hd, score_elements(T)) * item)
        if self.qk:
            att += rmsnorm_cache_bytes(n * H, self.hd, item) + rmsnorm_cache_bytes(n * K, self.hd, item)
        layer = 2 * rmsnorm_cache_bytes(ns, C, item) + (2 * ns * C + swiglu_cache_elements(n * self.F // tp)) * item + att
        scores = 0 if self.flash or cp > 1 else rows * H * score_elements(T) * item
        # W stash (split backward), as gpt's: dy, the gating, dg, du, h2; dx, a, dq, dk, dv, h
        heads = 2 * (self.H + self.K) * self.hd       # a and dq (n_heads wide), dk and dv (n_kv_heads wide)
        w = n * (2 * C + 2 * C // parts + (3 * self.F + heads) // tp) * item
        # of those, what only GEMMs read: h2, h, the gating, dg, du, a (attention on this rank; and dv under
        # flash attention, whose gradients are bits) and, without q/k norms, dq and dk
        a_bits = (n * (self.H + (self.K if self.flash else 0)) * self.hd // tp if cp == 1 else 0) + \
            (0 if self.qk else n * (self.H + self.K) * self.hd // tp)
        bits = n * (2 * C // parts + 3 * self.F // tp) + a_bits
        out = {"layer": layer, "scores": scores, "w_layer": w, "bits_w_layer": bits, **end_cache_bytes(self.cfg, rows, tp, item, amp, share,
                                                 rmsnorm_cache_bytes(ns, C, item), parts, cp)}
        moe = w_moe = None
        if self.moe is not None:     # an MoE layer: the attention's part, then the router's and experts'
            moe = (2 * rmsnorm_cache_bytes(ns, C, item) + ns * C * item + att + self.moe.cache_bytes(n, C, item, tp))
            w_moe = n * (C + C // parts + heads // tp) * item    # the attention's W stash
            for i in range(self.L):
                if self.moe.routed(i):
                    out[f"layer.{i}"], out[f"w_layer.{i}"] = moe, w_moe
                    out[f"bits_w_layer.{i}"] = n * C // parts + a_bits    # h, a, dq, dk (the router reads h2 in float32)
        self._mtp_cache_bytes(out, n, ns, item, moe or layer, w_moe or w)
        return out

    def _mtp_cache_bytes(self, out: dict, n: int, ns: int, item: int, block: int, w_block: int) -> None:
        """Adds the multi-token prediction modules' bytes to the head's (in out): each module its embedding's,
        three norms', the projection's input (2C), its block's (`block`; `w_block` its W stash; an MoE one for an
        MoE model) and its own loss's with the mask of its counted targets (one byte a position). n tokens, ns of
        them this rank's piece (sequence parallelism)."""
        if self.mtp is None:
            return
        C, D = self.C, self.mtp.D
        one = (embedding_cache_bytes(n) + 3 * rmsnorm_cache_bytes(ns, C, item) + 2 * ns * C * item
               + block + out["head"] - rmsnorm_cache_bytes(ns, C, item) + n)
        out["head"] += D * one
        out["w_head"] += D * (w_block + out["w_head"] + 2 * ns * C * item)

    # the tensors only linear layers read (packed bf16 storage hands them to the GEMMs as bits: gemm_weight); not
    # the router's (its logits are float32) nor the routed experts' (grouped products of their own)
    GEMM_WEIGHTS = (".attn.q.w", ".attn.k.w", ".attn.v.w", ".attn.o.w", ".mlp.gate.w", ".mlp.up.w", ".mlp.down.w",
                    ".moe.shared.gate.w", ".moe.shared.up.w", ".moe.shared.down.w", "lm_head.w")

    def gemm_weight(self, name: str) -> bool:
        return name.endswith(self.GEMM_WEIGHTS)

    def tp_allreduces(self) -> tuple:
        """Activation allreduces per layer under tensor parallelism: (forward, backward); the attention's and
        the MLP's reduce_from_tp forward and copy_to_tp backward."""
        return (2, 2)

    def sp_regathers(self) -> int:
        """Region entries per layer whose linear gathers its input again in backward under sequence parallelism:
        the attention's and the MLP's first linears keep only this rank's piece of their input."""
        return 2

    def attention_flops(self, tokens: int, tp: int) -> int:
        """Forward FLOPs of one layer's scores and their product with the values: 2 T hd per token and query
        head each (grouping the key/value heads saves projections, not these)."""
        return 4 * tokens * self.T * self.hd * self.H // tp

    def attention_flops_text(self) -> tuple:
        """A step's attention FLOPs per token, forward and backward, over every layer (3 x attention_flops), and
        what the term counts."""
        return ("12 x L x T x H x hd", "12 L T H hd = attention scores and values (H x hd = d_model unless "
                "model.head_dim is set)")

    def decode_cache_elements(self) -> int:
        """Every layer's n_kv_heads keys and values (head_dim each) per token: decode_cache's KVCache."""
        return 2 * self.L * self.K * self.hd

    def specs(self, block: str) -> list[ParamSpec]:
        C, std = self.C, self.std
        if block == "embed":
            return embed_specs(self.V, C, self.Vp)
        if block == "head":
            out = [ParamSpec("norm.w", (C,), decay=False, init="ones", block="head")]
            if not self.tied:
                out.append(ParamSpec("lm_head.w", (C, self.Vp), tp_dim=1, std=std, block="head",
                                     true_shape=(C, self.V) if self.Vp != self.V else None))
            return out + (self.mtp.specs() if self.mtp is not None else [])
        return self.block_specs(block, self._routed(int(block.split(".")[1])))

    def block_specs(self, p: str, routed: bool) -> list[ParamSpec]:
        """The tensors of one transformer block named p (a layer "h.{i}", or a multi-token prediction module's);
        routed: an MoE block (else the dense MLP)."""
        C, std = self.C, self.std
        out_std = std / math.sqrt(2 * self.L)   # residual projections scaled down, as GPT-2 does
        mlp = ([ParamSpec(f"{p}.mlp.gate.w", (C, self.F), tp_dim=1, std=std, block=p),
                ParamSpec(f"{p}.mlp.up.w", (C, self.F), tp_dim=1, std=std, block=p),
                ParamSpec(f"{p}.mlp.down.w", (self.F, C), tp_dim=0, std=out_std, block=p)]
               if not routed else self.moe.specs(p, C, std, out_std))
        return [ParamSpec(f"{p}.attn_norm.w", (C,), decay=False, init="ones", block=p)] + \
            self._attention_specs(p, std, out_std) + [
                ParamSpec(f"{p}.mlp_norm.w", (C,), decay=False, init="ones", block=p)] + mlp

    def _attention_specs(self, p: str, std: float, out_std: float) -> list[ParamSpec]:
        """Block p's attention weights: q, k, v, o and the q/k norms' (qk_norm)."""
        C, hd = self.C, self.hd
        return [ParamSpec(f"{p}.attn.q.w", (C, self.H * hd), tp_dim=1, std=std, block=p),
                ParamSpec(f"{p}.attn.k.w", (C, self.K * hd), tp_dim=1, std=std, block=p),
                ParamSpec(f"{p}.attn.v.w", (C, self.K * hd), tp_dim=1, std=std, block=p),
                ParamSpec(f"{p}.attn.o.w", (self.H * hd, C), tp_dim=0, std=out_std, block=p)] + self._qk_specs(p)

    def _qk_specs(self, p: str) -> list[ParamSpec]:
        """The q and k norms' weights (qk_norm): one (head_dim,) weight each, shared by all heads."""
        return [ParamSpec(f"{p}.attn.{a}_norm.w", (self.hd,), decay=False, init="ones", block=p, tp_partial=True)
                for a in "qk"] if self.qk else []

    def all_specs(self) -> list[ParamSpec]:
        return [s for b in self.blocks() for s in self.specs(b.name)]

    def rope(self, xp, dtype):
        """(cos, sin) and the query's (cos, sin) with 1/sqrt(hd) folded in, made once per array module and dtype."""
        key = (xp.__name__, str(dtype))
        if key not in self._tables:
            th = self.cfg.rope_theta
            self._tables[key] = (rope_tables(xp, self.T, self.hd, th, dtype),
                                 rope_tables(xp, self.T, self.hd, th, dtype, 1.0 / math.sqrt(self.hd)))
        return self._tables[key]

    # --- blocks -------------------------------------------------------------------------------
    def embed_forward(self, xp, P, idx, ctx):
        # idx: (B, T) -> x: (B, T, C)
        return tok_embed_forward(xp, P, idx, ctx)

    def embed_backward(self, xp, dx, cache, G, ctx, defer=None):
        # dx: (B, T, C) -> None
        tok_embed_backward(xp, dx, cache, G, ctx, defer)

    def layer_forward(self, xp, P, i, x, ctx, keep_scores=True, loss=None):
        # x: (B, T, C) -> (B, T, C)
        # keep_scores=False (selective recompute): the cache drops the attention probabilities, which
        # layer_backward rebuilds; flash attention keeps none anyway. loss: (norm, loss scale) of a training
        # pass, which an MoE layer's balancing losses need (models/moe_mlp.py); None when only inferring
        sink = None if loss is None else ctx.logits.sink(i)     # MuonClip: the training forwards' largest logits
        return self.block_forward(xp, P, f"h.{i}", self._routed(i), x, ctx, keep_scores, loss, sink)

    def block_forward(self, xp, P, p, routed, x, ctx, keep_scores=True, loss=None, sink=None):
        # x: (B, T, C) -> (B, T, C): the block named p (routed: MoE); sink: where its largest logits go (None: nowhere)
        o, c_a = self._attention_forward(xp, P, p, x, ctx, keep_scores, sink)
        return self._mlp_forward(xp, P, p, routed, o, ctx, loss, c_a)

    # the attention's part of a block's cache: its first ATTENTION_CACHE entries (the MLP's follow)
    ATTENTION_CACHE = 5

    def _attention_forward(self, xp, P, p, x, ctx, keep_scores, sink):
        # x: (B, T, C) -> x + attention(rmsnorm(x)) (a new array), the attention's cache entries
        B, T = x.shape[0], x.shape[1] * ctx.seq.parts   # T: the whole sequence
        H, K, hd = P[f"{p}.attn.q.w"].shape[1] // self.hd, P[f"{p}.attn.k.w"].shape[1] // self.hd, self.hd
        cos, sin, qcos, qsin = self._tables_at(xp, x.dtype, ctx)
        hs, c_n1 = rmsnorm_forward(xp, x, P[f"{p}.attn_norm.w"], self.eps, num=ctx.num)
        # under bf16 amp the projections' outputs are stored in bfloat16 where bits-reading kernels or the
        # attention's products take them (_attention_num): v, and q and k unless the q/k norms read them
        att = self._attention_num(ctx)
        qk = ctx.num.float32_out if self.qk else att
        (q, k, v), c_qkv = columns_forward(xp, ctx, hs, (P[f"{p}.attn.q.w"], P[f"{p}.attn.k.w"], P[f"{p}.attn.v.w"]),
                                           nums=(qk, qk, att))
        del hs
        q, k, c_qk = self._qk_forward(xp, P, p, q.reshape(B, T, H, hd), k.reshape(B, T, K, hd))
        q = rope_forward(xp, q, qcos, qsin, att)
        k = rope_forward(xp, k, cos, sin, att)
        k, v = ctx.attn.kv_forward(k, v.reshape(B, T, K, hd).transpose(0, 2, 1, 3))
        a, c_att = ctx.attn.grouped_forward(xp, self._cores(ctx, keep_scores)[0], q, k, v, scale=1.0,  # q is scaled
                                            logits=sink)
        o, c_o = row_forward(xp, ctx, a, P[f"{p}.attn.o.w"])
        o += x                  # o is ours: the residual sum needs no new array
        return o, (c_n1, c_qkv, c_qk, c_att, c_o)

    def _mlp_forward(self, xp, P, p, routed, o, ctx, loss, c_a):
        # o: (B, T, C), the attention's output with its residual -> o + mlp(rmsnorm(o)) (in place), the block's cache
        # the router's logits are no bf16 GEMM: it reads float32
        h2s, c_n2 = rmsnorm_forward(xp, o, P[f"{p}.mlp_norm.w"], self.eps,
                                    num=ctx.num.float32_out if routed else ctx.num)
        if routed:
            d, c_moe = self.moe.forward(xp, P, p, h2s, ctx, loss)
            o += d
            return o, c_a + (c_n2, c_moe)
        (g, u), c_gu = columns_forward(xp, ctx, h2s, (P[f"{p}.mlp.gate.w"], P[f"{p}.mlp.up.w"]), nums=(ctx.num,) * 2)
        del h2s
        m, c_sw = swiglu_forward(xp, g, u, ctx.num)
        d, c_d = row_forward(xp, ctx, m, P[f"{p}.mlp.down.w"])
        del m
        o += d
        return o, c_a + (c_n2, c_gu, c_sw, linear_drop_input(c_d))

    def _attention_num(self, ctx):
        """The policy of the attention's inputs: bfloat16 (bits when packed) under bf16 amp for the grouped or
        flash core on this rank; float32 for context parallelism's drivers."""
        return ctx.num if ctx.attn.local_core else ctx.num.float32_out

    def _tables_at(self, xp, dtype, ctx):
        """cos, sin, and the query's (1/sqrt(hd) folded in) at the positions this rank's attention sees (packed
        documents: each row's, (B, T, hd/2))."""
        (cos, sin), (qcos, qsin) = self.rope(xp, dtype)
        pos = document_positions(ctx)
        if pos is not None:
            return tuple(t[pos] for t in (cos, sin, qcos, qsin))
        return tuple(ctx.attn.rows(t) for t in (cos, sin, qcos, qsin))

    def _cores(self, ctx, keep_scores=True):
        """The local attention core pair (grouped-query, or flash) handed ctx's precision and documents, dropping
        the probabilities when asked."""
        if self.flash:
            return document_cores(flash_gqa_forward, flash_gqa_backward, None, None, keep_scores, ctx)
        return document_cores(gqa_attention_forward, gqa_attention_backward, gqa_drop_scores, gqa_restore_scores,
                              keep_scores, ctx)

    def _qk_forward(self, xp, P, p, q, k):
        # q: (B, T, H, hd), k: (B, T, K, hd) -> the same, each head RMS-normalised (qk_norm; else as they are)
        if not self.qk:
            return q, k, None
        q, c_q = rmsnorm_forward(xp, q, P[f"{p}.attn.q_norm.w"], self.eps)
        k, c_k = rmsnorm_forward(xp, k, P[f"{p}.attn.k_norm.w"], self.eps)
        return q, k, (c_q, c_k)

    def _qk_backward(self, xp, dq, dk, cache, P, G, p):
        # dq: (B, T, H, hd), dk: (B, T, K, hd) -> the gradients of the norms' inputs (new arrays); the weight
        # gradients are taken here, in B, as every norm's are (nn/rmsnorm.py: rmsnorm_backward_input)
        if cache is None:
            return dq, dk
        c_q, c_k = cache
        return (rmsnorm_backward(xp, dq, c_q, P[f"{p}.attn.q_norm.w"], G[f"{p}.attn.q_norm.w"]),
                rmsnorm_backward(xp, dk, c_k, P[f"{p}.attn.k_norm.w"], G[f"{p}.attn.k_norm.w"]))

    def layer_backward(self, xp, dy, cache, P, G, i, ctx, defer=None):
        # dy: (B, T, C) -> dx: (B, T, C); defer: a list for the weight-gradient products (nn/deferred.py),
        # which read dy and the gradients below as made here: none of them is written after it is made
        return self.block_backward(xp, dy, cache, P, G, f"h.{i}", self._routed(i), ctx, defer)

    def block_backward(self, xp, dy, cache, P, G, p, routed, ctx, defer=None):
        # dy: (B, T, C) -> dx: (B, T, C), the backward of block_forward
        n = self.ATTENTION_CACHE
        dx = self._mlp_backward(xp, dy, cache[n:], P, G, p, routed, ctx, defer)
        return self._attention_backward(xp, dx, cache[:n], P, G, p, ctx, defer)

    def _mlp_backward(self, xp, dy, cache, P, G, p, routed, ctx, defer):
        # dy: (B, T, C) -> the gradient of the MLP's residual input o (a new array)
        if routed:     # the routed experts run whole in B (their weight gradients are not deferred)
            c_n2, c_moe = cache
            dh2 = self.moe.backward(xp, dy, c_moe, P, G, p, ctx)
        else:
            c_n2, c_gu, c_sw, c_d = cache
            c_d = linear_restore_input(c_d, swiglu_recompute(xp, c_sw, ctx.num))
            dm = row_backward(xp, ctx, dy, c_d, P[f"{p}.mlp.down.w"], G[f"{p}.mlp.down.w"], defer=defer)
            del c_d
            dg, du = swiglu_backward(xp, dm, c_sw, ctx.num)
            dh2 = columns_backward(xp, ctx, (dg, du), c_gu, (P[f"{p}.mlp.gate.w"], P[f"{p}.mlp.up.w"]),
                                   (G[f"{p}.mlp.gate.w"], G[f"{p}.mlp.up.w"]), defer=defer)
        dx = rmsnorm_backward(xp, dh2, c_n2, P[f"{p}.mlp_norm.w"], G[f"{p}.mlp_norm.w"])
        dx += dy
        return dx

    def _attention_backward(self, xp, dx, cache, P, G, p, ctx, defer):
        # dx: (B, T, C), the gradient of the attention's residual output -> that of the block's input x
        cos, sin, qcos, qsin = self._tables_at(xp, dx.dtype, ctx)
        c_n1, c_qkv, c_qk, c_att, c_o = cache
        da = row_backward(xp, ctx, dx, c_o, P[f"{p}.attn.o.w"], G[f"{p}.attn.o.w"], defer=defer)
        dq, dk, dv = ctx.attn.grouped_backward(xp, self._cores(ctx)[1], da, c_att)
        dk, dv = ctx.attn.kv_backward(dk, dv)
        # without q/k norms only the projections' GEMMs read the rotated-back gradients
        dnum = ctx.num.float32_out if self.qk else ctx.num
        dq, dk = rope_backward(xp, dq, qcos, qsin, dnum), rope_backward(xp, dk, cos, sin, dnum)
        dq, dk = self._qk_backward(xp, dq, dk, c_qk, P, G, p)
        dys = (dq, dk, dv.transpose(0, 2, 1, 3))
        dh = columns_backward(xp, ctx, dys, c_qkv, (P[f"{p}.attn.q.w"], P[f"{p}.attn.k.w"], P[f"{p}.attn.v.w"]),
                              (G[f"{p}.attn.q.w"], G[f"{p}.attn.k.w"], G[f"{p}.attn.v.w"]), defer=defer)
        dn = rmsnorm_backward(xp, dh, c_n1, P[f"{p}.attn_norm.w"], G[f"{p}.attn_norm.w"])
        dn += dx            # into the new array: a deferred W still reads dx (a + b is b + a, bit for bit)
        return dn

    def qk_columns(self, i: int, tp: int) -> tuple[tuple[QKColumns, ...], int]:
        """Where layer i's query and key columns of each of a tp rank's heads sit (q and k are head-major), and the
        query heads per key/value head."""
        p, hd = f"h.{i}.attn", self.hd
        return (QKColumns(f"{p}.q.w", "q", 0, hd, hd), QKColumns(f"{p}.k.w", "k", 0, hd, hd)), self.H // self.K

    def layer_stats(self, i, cache):
        """The MoE statistics of layer i's forward (models/moe_mlp.MoEStats), None for a dense layer."""
        return self.block_stats(cache, self._routed(i))

    def block_stats(self, cache, routed: bool):
        """The MoE statistics in a block_forward cache (routed: an MoE block), None for a dense block."""
        return cache[-1][-1] if routed else None

    def head_forward(self, xp, P, x, targets, norm, ctx):
        # x: (B, T, C) -> loss
        # multi-token prediction (a training pass with ctx.ahead) adds its weighted loss, read from x as well
        h, c_n = rmsnorm_forward(xp, x, P["norm.w"], self.eps, num=ctx.num)
        loss, c = logits_loss_forward(xp, P, h, targets, norm, ctx, self.tied)
        c_m = None
        if self.mtp is not None and ctx.ahead is not None:
            extra, c_m = self.mtp.forward(xp, P, x, targets, norm, ctx)
            loss = loss + extra
        return loss, (c_n, c, c_m)

    def head_backward(self, xp, cache, G, ctx, P, dloss=1.0, defer=None):
        # -> dx: (B, T, C)
        c_n, c, c_m = cache
        dmtp = None if c_m is None else self.mtp.backward(xp, c_m, P, G, ctx, dloss, defer)
        dh = logits_loss_backward(xp, c, G, ctx, self.tied, P, dloss, defer)
        dx = rmsnorm_backward(xp, dh, c_n, P["norm.w"], G["norm.w"])
        if dmtp is not None:
            dx += dmtp
        return dx

    # --- incremental decoding (models/decode.py) ------------------------------------------------
    def decode_cache(self, xp, dtype):
        return [KVCache(xp, self.K, self.T, self.hd, dtype) for _ in range(self.L)]

    def decode_embed(self, xp, P, ids, start):
        return P["wte"][ids]

    def decode_layer(self, xp, P, i, x, cache, start):
        p, n, H, K, hd = f"h.{i}", x.shape[1], self.H, self.K, self.hd
        pos = slice(start, start + n)                       # rotary positions continue after the cache
        (cos, sin), (qcos, qsin) = self.rope(xp, x.dtype)
        h, _ = rmsnorm_forward(xp, x, P[f"{p}.attn_norm.w"], self.eps)
        q, _ = linear_forward(xp, h, P[f"{p}.attn.q.w"])
        k, _ = linear_forward(xp, h, P[f"{p}.attn.k.w"])
        v, _ = linear_forward(xp, h, P[f"{p}.attn.v.w"])
        q, k, _ = self._qk_forward(xp, P, p, q.reshape(1, n, H, hd), k.reshape(1, n, K, hd))
        q = rope_forward(xp, q, qcos[pos], qsin[pos])[0]                           # (H, n, hd), scaled
        k = rope_forward(xp, k, cos[pos], sin[pos])[0]                             # (K, n, hd)
        v = v[0].reshape(n, K, hd).transpose(1, 0, 2)
        a = cache.attend(xp, q.reshape(K, H // K, n, hd), k, v, start)             # query head h: kv head h // g
        a = a.reshape(H, n, hd).transpose(1, 0, 2).reshape(1, n, H * hd)
        o, _ = linear_forward(xp, xp.ascontiguousarray(a), P[f"{p}.attn.o.w"])
        o += x
        return self._decode_mlp(xp, P, i, o)

    def _decode_mlp(self, xp, P, i, o):
        # o: (1, n, C), the attention's output with its residual -> o + mlp(rmsnorm(o))
        p = f"h.{i}"
        h2, _ = rmsnorm_forward(xp, o, P[f"{p}.mlp_norm.w"], self.eps)
        if self._routed(i):
            return o + self.moe.forward(xp, P, p, h2, LOCAL, None)[0]
        g, _ = linear_forward(xp, h2, P[f"{p}.mlp.gate.w"])
        u, _ = linear_forward(xp, h2, P[f"{p}.mlp.up.w"])
        m, _ = swiglu_forward(xp, g, u)
        d, _ = linear_forward(xp, m, P[f"{p}.mlp.down.w"])
        return o + d

    def head_logits(self, xp, P, x):
        h, _ = rmsnorm_forward(xp, x, P["norm.w"], self.eps)
        return output_logits(xp, P, h, self.tied, self.V)
