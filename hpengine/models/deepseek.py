"""DeepSeek-V3 / Kimi K2 decoder (the semantics of Hugging Face's DeepseekV3ForCausalLM): the llama kind's pre-norm
blocks, embedding, head, dense SwiGLU MLPs and routed experts (models/llama.py, moe_mlp.py), with multi-head latent
attention (nn/mla.py) in place of grouped-query attention, YaRN rope scaling, and decoding from the latent cache.
"""
from __future__ import annotations

from hpengine.device.bf16_bits import as_float32
from hpengine.models.common import document_positions, end_cache_bytes
from hpengine.models.interface import Capabilities
from hpengine.models.llama import Llama
from hpengine.models.tp_layers import row_backward, row_forward
from hpengine.nn import (
    rmsnorm_backward,
    rmsnorm_cache_bytes,
    rmsnorm_forward,
    rope_tables,
    score_elements,
    swiglu_cache_elements,
)
from hpengine.nn.mla import MLADims, mla_cache_bytes, mla_project, mla_project_backward
from hpengine.nn.mla_decode import LatentCache, mla_decode
from hpengine.nn.ring_attention import context_cache_bytes
from hpengine.nn.rope import YaRN
from hpengine.params.buffers import ParamSpec


def mla_dims(mcfg, n_heads: int | None = None) -> MLADims:
    """The MLA widths of a deepseek [model] config (n_heads: a tp rank's heads; default all), with YaRN's
    softmax mscale when rope scaling is on."""
    a, y = mcfg.mla, yarn_of(mcfg)
    return MLADims(n_heads=n_heads or mcfg.n_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                   qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                   v_head_dim=a.v_head_dim, mscale=1.0 if y is None else y.softmax_mscale())


def yarn_of(mcfg) -> YaRN | None:
    """model.rope_scaling as nn/rope.py's YaRN, None for type "none"."""
    r = mcfg.rope_scaling
    if r.type == "none":
        return None
    return YaRN(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                beta_fast=r.beta_fast, beta_slow=r.beta_slow, mscale=r.mscale, mscale_all_dim=r.mscale_all_dim)


# Tensor parallelism splits MLA by heads, as Megatron-Core does: q (or q_b) and kv_b by output columns (whole heads,
# each head's columns contiguous), o by rows; q_a, kv_a and their norms (the bottlenecks, which every head reads) are
# replicated, and the attention is one tp region entered with every token of the sequence (ctx.tp.copy_to_tp). Each
# rank's gradient of a replicated bottleneck weight is its heads' part (ParamSpec.tp_partial: summed over tp), and
# its input gradient is partial too (summed by copy_to_tp_backward). Under context parallelism the rotary key has
# been written into every head's key before the drivers (strategies/context_parallel.py) see it, and v is padded
# with zero columns to the q/k width there (the drivers move k and v as one array): the padded columns' outputs and
# gradients are exactly zero and are cut off again.
class DeepSeek(Llama):
    """model.kind = "deepseek": Llama's blocks with multi-head latent attention (model.mla, model.rope_scaling)."""
    # what only GEMMs read (packed bf16 storage hands these to the layers as bits): MLA's matrices (nn/mla.py reads
    # them only through its linears; o.w's shape also gives a rank's heads) and the llama kind's MLP and head
    GEMM_WEIGHTS = (".attn.q.w", ".attn.q_a.w", ".attn.q_b.w", ".attn.kv_a.w", ".attn.kv_b.w", ".attn.o.w",
                    ".mlp.gate.w", ".mlp.up.w", ".mlp.down.w", ".moe.shared.gate.w", ".moe.shared.up.w",
                    ".moe.shared.down.w", "lm_head.w")
    ATTENTION_CACHE = 2

    @staticmethod
    def capabilities(mcfg) -> Capabilities:
        """MLA: every head its own key (nope + rope wide) and value (v_head_dim wide); routed experts where model.moe
        has them."""
        a, e = mcfg.mla, mcfg.moe
        return Capabilities(attention=True, qk_width=a.qk_nope_head_dim + a.qk_rope_head_dim, v_width=a.v_head_dim,
                            kv_heads=mcfg.n_heads, experts=e.num_experts,
                            capacity_factor=e.capacity_factor if e.num_experts else 0.0,
                            top_k=e.top_k if e.num_experts else 0, mtp_depth=mcfg.mtp.depth)

    def __init__(self, mcfg, tp_size: int = 1):
        super().__init__(mcfg, tp_size)
        self.mla, self.yarn = mla_dims(mcfg), yarn_of(mcfg)
        self.dense = self.moe is None or mcfg.moe.dense_layers > 0

    def tp_divides(self, tp: int) -> str:
        if self.H % tp or self.C % tp or (self.dense and self.F % tp):
            return (f"model.n_heads = {self.H}, model.d_model = {self.C}" +
                    (f" and the SwiGLU width {self.F}" if self.dense else "") +
                    " (each rank holds whole attention heads)")
        return self.moe.tp_divides(tp) if self.moe is not None else ""

    def _local_dims(self, P, p) -> MLADims:
        return mla_dims(self.cfg, P[f"{p}.attn.o.w"].shape[0] // self.mla.v_head_dim)

    def _attention_specs(self, p: str, std: float, out_std: float) -> list[ParamSpec]:
        """MLA's weights (MLADims.weight_shapes): the per-head ones split over tp, the bottlenecks replicated."""
        out = []
        for name, shape in self.mla.weight_shapes(self.C).items():
            full = f"{p}.attn.{name}"
            if name.endswith("norm.w"):
                out.append(ParamSpec(full, shape, decay=False, init="ones", block=p, tp_partial=True))
            elif name in ("q_a.w", "kv_a.w"):
                out.append(ParamSpec(full, shape, std=std, block=p, tp_partial=True))
            else:
                out.append(ParamSpec(full, shape, tp_dim=0 if name == "o.w" else 1,
                                     std=out_std if name == "o.w" else std, block=p))
        return out

    def _weights(self, P, p):
        return {name: P[f"{p}.attn.{name}"] for name in self.mla.weight_shapes(self.C)}

    def mla_tables(self, xp, dtype):
        """cos, sin (seq_len, qk_rope_head_dim / 2), YaRN's frequencies and attention factor when it is on."""
        key = ("mla", xp.__name__, str(dtype))
        if key not in self._tables:
            self._tables[key] = rope_tables(xp, self.T, self.mla.qk_rope_head_dim, self.cfg.rope_theta, dtype,
                                            yarn=self.yarn)
        return self._tables[key]

    def _mla_tables_at(self, xp, dtype, ctx):
        cos, sin = self.mla_tables(xp, dtype)
        pos = document_positions(ctx)
        if pos is not None:
            return cos[pos], sin[pos]
        return ctx.attn.rows(cos), ctx.attn.rows(sin)

    def _attention_forward(self, xp, P, p, x, ctx, keep_scores, sink):
        # x: (B, T, C) -> x + mla(rmsnorm(x)) (a new array), the attention's cache entries; sink: unused (no MuonClip)
        d = self._local_dims(P, p)
        cos, sin = self._mla_tables_at(xp, x.dtype, ctx)
        hs, c_n1 = rmsnorm_forward(xp, x, P[f"{p}.attn_norm.w"], self.eps, num=ctx.num)
        h = ctx.tp.copy_to_tp(hs)           # every token of the sequence (gathered under sequence parallelism)
        del hs
        q, k, v, c_p = mla_project(xp, h, self._weights(P, p), d, cos, sin, ctx.num)
        del h
        k, v = ctx.attn.kv_forward(k, v)
        v, pad = self._padded(xp, v, q.shape[-1], ctx)
        a, c_att = ctx.attn.grouped_forward(xp, self._cores(ctx, keep_scores)[0], q, k, v, scale=1.0)  # q is scaled
        if pad:
            B, T = a.shape[:2]
            a = xp.ascontiguousarray(a.reshape(B, T, d.n_heads, -1)[..., :d.v_head_dim]).reshape(B, T, -1)
        o, c_o = row_forward(xp, ctx, a, P[f"{p}.attn.o.w"])
        o += x
        return o, (c_n1, (c_p, c_att, c_o))

    @staticmethod
    def _padded(xp, v, width, ctx):
        """v (B, H, T, dv) zero-padded to the q/k width for the context-parallel drivers (which move k and v as one
        array); as it is for the local core. -> (v, padded?)"""
        if ctx.attn.local_core or v.shape[-1] == width:
            return v, False
        out = xp.zeros(v.shape[:-1] + (width,), dtype=v.dtype)
        out[..., :v.shape[-1]] = v
        return out, True

    def _attention_backward(self, xp, dx, cache, P, G, p, ctx, defer):
        # dx: (B, T, C), the gradient of the attention's residual output -> that of the block's input x
        d = self._local_dims(P, p)
        cos, sin = self._mla_tables_at(xp, dx.dtype, ctx)
        c_n1, (c_p, c_att, c_o) = cache
        da = row_backward(xp, ctx, dx, c_o, P[f"{p}.attn.o.w"], G[f"{p}.attn.o.w"], defer=defer)
        w = d.qk_head_dim
        if not ctx.attn.local_core and d.v_head_dim != w:
            B, T = da.shape[:2]
            dap = xp.zeros((B, T, d.n_heads, w), dtype=da.dtype)
            dap[..., :d.v_head_dim] = da.reshape(B, T, d.n_heads, d.v_head_dim)
            da = dap.reshape(B, T, -1)
        dq, dk, dv = (as_float32(xp, g) for g in ctx.attn.grouped_backward(xp, self._cores(ctx)[1], da, c_att))
        del da
        dk, dv = ctx.attn.kv_backward(dk, dv)
        dv = dv[..., :d.v_head_dim]
        dh = mla_project_backward(xp, dq, dk, dv, c_p, self._weights(P, p), self._grads(G, p), d, cos, sin, ctx.num)
        dh = ctx.tp.copy_to_tp_backward(dh)
        dn = rmsnorm_backward(xp, dh, c_n1, P[f"{p}.attn_norm.w"], G[f"{p}.attn_norm.w"])
        dn += dx
        return dn

    def _grads(self, G, p):
        return {name: G[f"{p}.attn.{name}"] for name in self.mla.weight_shapes(self.C)}

    def qk_columns(self, i: int, tp: int):
        raise ValueError("optim.muon_qk_clip is not built for multi-head latent attention (model.kind = 'deepseek'): "
                         "set it to 0")

    # --- planner facts ------------------------------------------------------------------------
    def attention_flops(self, tokens: int, tp: int) -> int:
        """Forward FLOPs of one layer's scores (nope + rope wide) and their product with the values (v wide) per
        token and head, over all seq_len keys: 2 T H (nope + rope + v), planner/sizes.MLAShape's count."""
        d = self.mla
        return 2 * tokens * self.T * self.H * (d.qk_head_dim + d.v_head_dim) // tp

    def sp_regathers(self) -> int:
        """Under sequence parallelism only the MLP's entry gathers its input again in backward: MLA's projections
        keep the whole sequence copy_to_tp gathered (their bottlenecks read it twice)."""
        return 1

    def attention_flops_text(self) -> tuple:
        return ("6 x L x T x H x (nope + rope + v)", "6 L T H (nope + rope + v) = attention scores over "
                "qk_nope_head_dim + qk_rope_head_dim wide queries and keys, and values v_head_dim wide")

    def decode_cache_elements(self) -> int:
        """Every layer's latent (kv_lora_rank) and shared rotary key (qk_rope_head_dim) per token: decode_cache's
        LatentCache, where plain multi-head attention would keep H (nope + rope + v)."""
        return self.L * (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)

    def cache_bytes(self, rows: int, tp: int, item: int, amp: bool, share: int, parts: int = 1, cp: int = 1,
                    cp_comm: str = "ring") -> dict:
        """Bytes the forward caches per micro-batch, by block kind, as the llama kind counts them, with MLA's cache
        (nn/mla.mla_cache_bytes: the gathered input, the bottleneck norms, a tp rank's heads' q, k, v, output
        and probabilities) in place of the grouped-query attention's; model.attention = "flash" keeps one
        log-sum-exp per row and head in place of the probabilities (nn/flash.flash_cache_bytes' count); under
        context parallelism the drivers' cache of every head's key and the padded value."""
        T, C = self.T // cp, self.C
        n, d = rows * T, mla_dims(self.cfg, self.H // tp)
        ns = n // parts
        att = mla_cache_bytes(rows, T, C, d, item, 0 if cp > 1 or self.flash else score_elements(T))
        if self.flash and cp == 1:
            att += n * d.n_heads * max(item, 4)
        if cp > 1:      # the core's q, k, v, output: the drivers' (v padded to the q/k width)
            Hl, w = d.n_heads, d.qk_head_dim
            att += context_cache_bytes(rows, T, Hl, Hl, w, item, cp, cp_comm) - n * Hl * (2 * w + 2 * d.v_head_dim) * item
            if d.v_head_dim != w:   # the heads' outputs merged for o: cut to v_head_dim wide, always a new array
                att += n * Hl * d.v_head_dim * item - (n * Hl * w * item if Hl > 1 and T > 1 else 0)
        att += rmsnorm_cache_bytes(ns, C, item)
        scores = 0 if cp > 1 or self.flash else rows * d.n_heads * score_elements(T) * item
        mlp = rmsnorm_cache_bytes(ns, C, item) + (ns * C + swiglu_cache_elements(n * self.F // tp)) * item
        heads = n * d.n_heads * d.v_head_dim * item       # o's input, the attention's W stash with dy
        w = n * (2 * C + C // parts + 3 * self.F // tp) * item + heads
        out = {"layer": att + mlp, "scores": scores, "w_layer": w, "bits_w_layer": n * (C // parts + 3 * self.F // tp),
               **end_cache_bytes(self.cfg, rows, tp, item, amp, share, rmsnorm_cache_bytes(ns, C, item), parts, cp)}
        moe = w_moe = None
        if self.moe is not None:
            moe = att + rmsnorm_cache_bytes(ns, C, item) + self.moe.cache_bytes(n, C, item, tp)
            w_moe = n * C * item + heads
            for i in range(self.L):
                if self.moe.routed(i):
                    out[f"layer.{i}"], out[f"w_layer.{i}"] = moe, w_moe
                    out[f"bits_w_layer.{i}"] = 0
        self._mtp_cache_bytes(out, n, ns, item, moe or att + mlp, w_moe or w)
        return out

    # --- incremental decoding: the latent cache (nn/mla_decode.py) ------------------------------
    def decode_cache(self, xp, dtype):
        return [LatentCache(xp, self.T, self.mla, dtype) for _ in range(self.L)]

    def decode_layer(self, xp, P, i, x, cache, start):
        p, n = f"h.{i}", x.shape[1]
        cos, sin = self.mla_tables(xp, x.dtype)
        h, _ = rmsnorm_forward(xp, x, P[f"{p}.attn_norm.w"], self.eps)
        o = mla_decode(xp, h, self._weights(P, p), self.mla, cos[start:start + n], sin[start:start + n], cache, start)
        o += x
        return self._decode_mlp(xp, P, i, o)


__all__ = ["DeepSeek", "mla_dims", "yarn_of"]
