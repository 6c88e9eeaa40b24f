"""The routed-experts MLP of a llama-kind MoE layer (Mixtral, Qwen3-MoE, DeepSeek-V3): a router to num_experts
logits, each token's top_k SwiGLU experts (within its best groups, when grouped) weighted by their gates
(nn/moe.py), and optionally one always-on shared SwiGLU expert added to the routed sum. Layers before
moe.dense_layers keep the dense MLP.
"""
from __future__ import annotations

import math

from hpengine.nn import swiglu_backward, swiglu_forward, swiglu_recompute
from hpengine.nn.linear import linear_backward, linear_forward
from hpengine.nn.moe import (
    experts_backward,
    experts_forward,
    grouped_swiglu_backward,
    grouped_swiglu_forward,
    moe_cache_bytes,
    moe_capacity,
    moe_combine_backward,
    moe_combine_forward,
    moe_permute,
    router_backward,
    router_forward,
    tokens_sum,
)
from hpengine.params.buffers import ParamSpec


# The balancing losses (aux, z) are part of the training loss: the layer's forward is handed (norm, loss scale)
# and keeps its figures, the weighted share among them, in its cache (MoEStats, which the engine reads through
# the model's layer_stats), and its backward adds their gradients. The experts' weights are one (E, C, F)
# tensor per projection, split over ep ranks along E under expert parallelism (ctx.ep); the router's is (C, E).
# Under tensor parallelism the experts split like the dense MLP (gate and up by columns, down by rows: each tp
# rank holds F / tp of every expert's width, and of the shared expert's): the layer is one tp region, entered
# with every token of the sequence (ctx.tp.copy_to_tp: gathered under sequence parallelism), whose partial
# outputs are summed on the way out. Every tp rank routes the same tokens the same way; the gates' gradient,
# partial over the width, is summed over tp; the router's own input gradient joins on tp rank 0 only (it is
# whole on every rank), and so does its weight gradient under sequence parallelism (where a replicated
# tensor's gradient is summed over tp).
class MoEMLP:
    """The MoE sub-block of one model config (moe.num_experts > 0)."""

    def __init__(self, mcfg, dense_width: int):
        e = mcfg.moe
        self.cfg, self.E, self.k, self.T = e, e.num_experts, e.top_k, mcfg.seq_len
        self.F, self.Fs = e.expert_hidden or dense_width, e.shared_hidden
        # (token, slot) assignments an expert takes per sequence in training; 0 = dropless
        self.capacity = math.ceil(e.capacity_factor * self.T * self.k / self.E) if e.capacity_factor > 0 else 0
        self.bias = None        # block prefix -> (E,) selection bias on the device; None = no bias

    # moe.capacity_factor > 0 caps each expert's assignments per sequence in training passes (nn/moe.moe_capacity;
    # evaluation and decoding stay dropless); set_bias installs the per-layer selection biases of aux-loss-free
    # balancing, which the engine keeps and updates (models/moe_bias.py).
    def set_bias(self, xp, bias) -> None:
        """The selection biases, (n_layers, E) float64 on the host (rows of dense layers unused); all zeros or
        None removes them, so an unbiased layer runs exactly as without."""
        if bias is None or not bias.any():
            self.bias = None
            return
        self.bias = {f"h.{i}": xp.asarray(bias[i]) for i in range(bias.shape[0]) if self.routed(i)}

    def routed(self, layer: int) -> bool:
        """Whether layer `layer` has routed experts (else the dense MLP)."""
        return layer >= self.cfg.dense_layers

    def specs(self, p: str, C: int, std: float, out_std: float) -> list[ParamSpec]:
        E, F, Fs = self.E, self.F, self.Fs
        out = [ParamSpec(f"{p}.moe.router.w", (C, E), std=std, decay=False, block=p),
               ParamSpec(f"{p}.moe.experts.gate.w", (E, C, F), tp_dim=2, std=std, block=p, ep_dim=0),
               ParamSpec(f"{p}.moe.experts.up.w", (E, C, F), tp_dim=2, std=std, block=p, ep_dim=0),
               ParamSpec(f"{p}.moe.experts.down.w", (E, F, C), tp_dim=1, std=out_std, block=p, ep_dim=0)]
        if Fs:
            out += [ParamSpec(f"{p}.moe.shared.gate.w", (C, Fs), tp_dim=1, std=std, block=p),
                    ParamSpec(f"{p}.moe.shared.up.w", (C, Fs), tp_dim=1, std=std, block=p),
                    ParamSpec(f"{p}.moe.shared.down.w", (Fs, C), tp_dim=0, std=out_std, block=p)]
        return out

    def tp_divides(self, tp: int) -> str:
        """The widths a tensor-parallel degree must divide ("" when it does)."""
        bad = [f"{what} = {n}" for what, n in (("the expert width model.moe.expert_hidden", self.F),
                                                ("model.moe.shared_hidden", self.Fs)) if n % tp]
        return " and ".join(bad) + " (each tp rank holds 1 / tp of every expert's width)" if bad else ""

    def forward(self, xp, P, p, h, ctx, loss=None):
        # h: (B, T_local, C) -> (B, T_local, C), cache; loss: (norm, loss scale) in training, None when only
        # inferring; ctx.ep moves the routed rows to the ranks of their experts and back (expert parallelism)
        h = ctx.tp.copy_to_tp(h)            # every token of the sequence, on every tp rank
        B, T, C = h.shape
        h2 = h.reshape(-1, C)
        e = self.cfg
        norm = loss[0] if loss else 1.0
        idx, gates, (aux, z), load, c_r = router_forward(xp, h2, P[f"{p}.moe.router.w"], self.k, T, norm,
                                                          e.router, e.norm_topk,
                                                          None if self.bias is None else self.bias.get(p), _seq_sum(ctx),
                                                          e.n_groups, e.topk_groups, e.routed_scaling)
        dropping, dropped = bool(self.capacity and loss), 0
        if dropping:        # a dropped slot: idx -1, gate 0; its row is never dispatched
            idx, gates = moe_capacity(xp, idx, gates, T, self.E, self.capacity)
            dropped = (idx < 0).sum()
        W = (P[f"{p}.moe.experts.gate.w"], P[f"{p}.moe.experts.up.w"], P[f"{p}.moe.experts.down.w"])
        if ctx.ep.size == 1:
            y, c_e = experts_forward(xp, h2, idx, gates, *W, dropping=dropping, num=ctx.num)
        else:       # this rank's rows to the ranks of their experts, this rank's experts on what arrives, back
            order, counts = moe_permute(xp, idx, self.E, dropping)
            xl, cl, plan = ctx.ep.dispatch(h2[order // self.k], counts)
            yl, c_g = grouped_swiglu_forward(xp, xl, cl, *W, num=ctx.num)
            y, c_c = moe_combine_forward(xp, ctx.ep.combine(yl, plan), order, gates, h2.shape[0])
            c_e = (order, c_g, plan, c_c)
        c_s = None
        if self.Fs:         # bfloat16 operands under bf16 amp; outputs as computed, as the routed experts' are
            f32 = ctx.num.float32_out
            g, c_sg = linear_forward(xp, h2, P[f"{p}.moe.shared.gate.w"], num=f32)
            u, _ = linear_forward(xp, h2, P[f"{p}.moe.shared.up.w"], num=f32)
            a, c_sw = swiglu_forward(xp, g, u, f32)
            s, _ = linear_forward(xp, a, P[f"{p}.moe.shared.down.w"], num=f32)
            y += s
            c_s = (c_sg, c_sw)
        share = (e.aux_loss * aux + e.z_loss * z) if loss else 0.0
        stats = MoEStats(aux if loss else 0.0, z if loss else 0.0, share, load, loss[1] if loss else 1.0, dropped)
        return ctx.tp.reduce_from_tp(y.reshape(B, T, C)), (c_r, c_e, c_s, stats)

    def backward(self, xp, dy, cache, P, G, p, ctx):
        # dy: (B, T_local, C) -> dh: (B, T_local, C)
        c_r, c_e, c_s, stats = cache
        dy = ctx.tp.reduce_from_tp_backward(dy)
        B, T, C = dy.shape
        dy2 = dy.reshape(-1, C)
        W = (P[f"{p}.moe.experts.gate.w"], P[f"{p}.moe.experts.up.w"], P[f"{p}.moe.experts.down.w"])
        GW = (G[f"{p}.moe.experts.gate.w"], G[f"{p}.moe.experts.up.w"], G[f"{p}.moe.experts.down.w"])
        if ctx.ep.size == 1:
            dh2, dgates = experts_backward(xp, dy2, c_e, *W, *GW, num=ctx.num)
        else:
            order, c_g, plan, c_c = c_e
            dys, dgates = moe_combine_backward(xp, dy2, c_c)
            dxl = grouped_swiglu_backward(xp, ctx.ep.combine_backward(dys, plan), c_g, *W, *GW, num=ctx.num)
            dh2 = tokens_sum(xp, ctx.ep.dispatch_backward(dxl, plan), order, dy2.shape[0], self.k)
        if c_s is not None:
            c_g, c_sw = c_s
            f32 = ctx.num.float32_out
            a = swiglu_recompute(xp, c_sw, f32)
            da = linear_backward(xp, dy2, (a, (dy2.shape[0],)), P[f"{p}.moe.shared.down.w"], G[f"{p}.moe.shared.down.w"],
                                 num=f32)
            del a
            dg, du = swiglu_backward(xp, da, c_sw, f32)
            dh2 += linear_backward(xp, dg, c_g, P[f"{p}.moe.shared.gate.w"], G[f"{p}.moe.shared.gate.w"], num=f32)
            dh2 += linear_backward(xp, du, c_g, P[f"{p}.moe.shared.up.w"], G[f"{p}.moe.shared.up.w"], num=f32)
        e, tp = self.cfg, ctx.tp
        if tp.size > 1:     # each rank's gates' gradient saw its share of the width
            dgates = tp.sum_partial(dgates)
        gw = G[f"{p}.moe.router.w"]
        if tp.rank > 0 and ctx.seq.parts > 1:      # summed over tp under sequence parallelism: rank 0's alone
            gw = xp.zeros_like(gw)
        dr = router_backward(xp, dgates, c_r, P[f"{p}.moe.router.w"], gw, e.aux_loss, e.z_loss, stats.scale,
                             _seq_sum(ctx))
        if tp.rank == 0:    # whole on every tp rank: counted once in the sum below
            dh2 += dr
        del dr
        return tp.copy_to_tp_backward(dh2.reshape(B, T, C))

    def cache_bytes(self, n: int, C: int, item: int, tp: int = 1) -> int:
        """Bytes one layer's routed experts (and shared expert) cache for n tokens (every token of the
        sequences, also under sequence parallelism), each tp rank 1 / tp of the widths."""
        out = moe_cache_bytes(n, self.k, self.E, C, self.F // tp, item)
        return out + (3 * n * self.Fs // tp * item if self.Fs else 0)      # the shared expert's g, u, sigmoid(g)


def _seq_sum(ctx):
    """Under context parallelism a rank holds part of every sequence: the per-sequence expert counts of the aux
    loss are summed over the cp ranks (ctx.attn); None when the rank holds whole sequences."""
    return ctx.attn.sequence_sum if ctx.attn.size > 1 else None


class MoEStats:
    """What one MoE layer's forward reports: its aux and z losses (this call's shares, unweighted), the
    weighted share added to the training loss, the selections per expert (before any drop), the loss scale its
    backward multiplies the balancing gradients by, and the (token, slot) assignments capacity dropped (a
    device scalar; 0 when dropless)."""
    __slots__ = ("aux", "z", "share", "load", "scale", "dropped")

    def __init__(self, aux, z, share, load, scale, dropped=0):
        self.aux, self.z, self.share, self.load, self.scale, self.dropped = aux, z, share, load, scale, dropped
