"""Multi-token prediction (DeepSeek-V3 section 2.2) for a model of the llama family: `depth` sequential modules
that run with the head, module k predicting from position i the token i + k + 1 through the model's shared
embedding and output head; their weighted mean loss joins the training loss. The block of each module comes from
the model (block_specs, block_forward, block_backward, block_stats), so any kind with llama's blocks plugs in.
"""
from __future__ import annotations

from dataclasses import replace

from hpengine.models.common import head_weight
from hpengine.models.tp_layers import vocab_embed_backward, vocab_embed_forward, vocab_loss_backward, vocab_loss_forward
from hpengine.nn import rmsnorm_backward, rmsnorm_forward, weight_grad
from hpengine.nn.linear import linear_backward_input, linear_backward_weight, linear_forward
from hpengine.params.buffers import ParamSpec


# Module k (tensors mtp.{k-1}.*, all in the head block) at position i, h the previous depth's hidden state (the
# main model's last block output before its final norm, for k = 1) and t the window's tokens:
#     u = eh_proj([enorm(Emb(t_{i+k})), hnorm(h_i)])      (2C -> C; the normed embedding first, as the released
#                                                           weights and every inference engine order them)
#     h'_i = block(u)_i  (causal over i, the model's positions and documents) -> the next depth's h
#     loss_k = CE(head(norm(h'_i)), t_{i+k+1}) over the counted targets / their global count
# loss = loss_weight / depth x sum_k loss_k (an MoE block's balancing losses weighted alike). The targets come as
# data.Batch.ahead (the main targets are t_{i+1}); a position whose target does not count (the last k of a row, or
# across a document) embeds token 0 in its place: only positions after it in its own document, none of which count
# at this depth or deeper, could see it. Under tensor parallelism eh_proj is replicated (each rank's gradient is
# whole, or under sequence parallelism partial over its positions, as a norm's); the embedding and the head are the
# vocabulary-parallel ones the model shares.
class MTP:
    """The multi-token prediction modules of `model` (a llama-family object) for a [model] config with mtp.depth > 0."""

    def __init__(self, model, mcfg):
        self.model, self.D, self.weight = model, mcfg.mtp.depth, mcfg.mtp.loss_weight
        self.C, self.eps, self.std = mcfg.d_model, mcfg.norm_eps, mcfg.init_std
        self.routed = model.moe is not None        # an MoE model's modules get an MoE block (DeepSeek-V3)

    def prefix(self, j: int) -> str:
        return f"mtp.{j}"

    def specs(self) -> list[ParamSpec]:
        """Every module's tensors, owned by the head block (its pipeline stage, its gather under sharding stage 3)."""
        C, out = self.C, []
        for j in range(self.D):
            p = self.prefix(j)
            out += [ParamSpec(f"{p}.enorm.w", (C,), decay=False, init="ones", block="head"),
                    ParamSpec(f"{p}.hnorm.w", (C,), decay=False, init="ones", block="head"),
                    ParamSpec(f"{p}.eh_proj.w", (2 * C, C), std=self.std, block="head")]
            out += [replace(s, block="head") for s in self.model.block_specs(p, self.routed)]
            out.append(ParamSpec(f"{p}.norm.w", (C,), decay=False, init="ones", block="head"))
        return out

    def forward(self, xp, P, x, targets, norm, ctx):
        # x: (B, T_local, C) the head's input, targets: (B, T) the main targets -> (weighted loss, cache)
        ah, m = ctx.ahead, self.model
        f32 = ctx.num.float32_out
        scale = self.weight / self.D
        loss_args = (norm, ah.scale * scale)       # an MoE block's balancing losses, weighted as the module's
        w, _ = head_weight(P, None, m.tied)
        h, caches, total, stats = x, [], None, 0.0
        for j in range(self.D):
            p = self.prefix(j)
            ids = targets if j == 0 else xp.maximum(ah.ids[..., j - 1], 0)      # t_{i+k}
            e, c_e = vocab_embed_forward(xp, ctx, ids, P["wte"])
            en, c_en = rmsnorm_forward(xp, e, P[f"{p}.enorm.w"], self.eps, num=f32)
            hn, c_hn = rmsnorm_forward(xp, h, P[f"{p}.hnorm.w"], self.eps, num=f32)
            u, c_u = linear_forward(xp, xp.concatenate([en, hn], axis=-1), P[f"{p}.eh_proj.w"], num=f32)
            del e, en, hn
            h, c_b = m.block_forward(xp, P, p, self.routed, u, ctx, loss=loss_args)
            st = m.block_stats(c_b, self.routed)
            if st is not None:
                stats += st.share
            hf, c_f = rmsnorm_forward(xp, h, P[f"{p}.norm.w"], self.eps, num=ctx.num)
            tgt = ah.ids[..., j]
            loss, c_l = vocab_loss_forward(xp, ctx, hf, w, xp.maximum(tgt, 0), ah.norms[j], mask=tgt >= 0)
            total = loss if total is None else total + loss
            caches.append((c_e, c_en, c_hn, c_u, c_b, c_f, c_l))
        if ah.record is not None:
            ah.record(total / self.D)
        return total * scale + stats * scale, caches

    def backward(self, xp, caches, P, G, ctx, dloss=1.0, defer=None):
        # -> dx: (B, T_local, C), the gradient of the head's input through every module; dloss: the amp loss scale
        m, C = self.model, self.C
        w, dw = head_weight(P, G, m.tied)
        dh = None           # the gradient of module j's output h' that module j + 1 sent back
        for j in reversed(range(self.D)):
            p = self.prefix(j)
            c_e, c_en, c_hn, c_u, c_b, c_f, c_l = caches[j]
            dhf = vocab_loss_backward(xp, ctx, c_l, w, dw, dloss * self.weight / self.D, defer)
            dy = rmsnorm_backward(xp, dhf, c_f, P[f"{p}.norm.w"], G[f"{p}.norm.w"])
            if dh is not None:
                dy += dh
            du = m.block_backward(xp, dy, c_b, P, G, p, self.routed, ctx, defer)
            dcat = linear_backward_input(xp, du, c_u, P[f"{p}.eh_proj.w"])
            weight_grad(defer, linear_backward_weight, xp, du, c_u, G[f"{p}.eh_proj.w"], held=(du, c_u))
            de = rmsnorm_backward(xp, dcat[..., :C], c_en, P[f"{p}.enorm.w"], G[f"{p}.enorm.w"])
            dh = rmsnorm_backward(xp, dcat[..., C:], c_hn, P[f"{p}.hnorm.w"], G[f"{p}.hnorm.w"])
            vocab_embed_backward(xp, ctx, de, c_e, G["wte"], defer)
        return dh
