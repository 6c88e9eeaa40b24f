"""Multi-head latent attention (DeepSeek-V2/V3; Hugging Face's DeepseekV3Attention): queries through an optional
low-rank bottleneck, per-head keys and values expanded from one compressed latent, one rotary key shared by every
head; attention over query/key heads wider than the value heads (nn/gqa.py), then the output projection.
"""
from __future__ import annotations

import dataclasses
import math

from hpengine.device.bf16_bits import as_float32
from hpengine.nn.gqa import gqa_attention_backward, gqa_attention_forward, gqa_drop_scores, gqa_restore_scores
from hpengine.nn.linear import linear_backward, linear_forward
from hpengine.nn.numerics import OFF
from hpengine.nn.rmsnorm import rmsnorm_backward, rmsnorm_cache_bytes, rmsnorm_forward
from hpengine.nn.rope import deinterleave, interleave, rope_backward, rope_forward


@dataclasses.dataclass(frozen=True)
class MLADims:
    """The widths of one MLA layer (model.mla) and its norms' eps; mscale multiplies the softmax scale
    1/sqrt(qk_nope_head_dim + qk_rope_head_dim) (YaRN.softmax_mscale(), 1 without rope scaling)."""
    n_heads: int
    q_lora_rank: int            # 0: one (C, H*qk_head_dim) query matrix
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    eps: float = 1e-6
    mscale: float = 1.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """The softmax scale, as Hugging Face's `scaling`: qk_head_dim^-1/2 times YaRN's mscale^2."""
        return self.mscale / math.sqrt(self.qk_head_dim)

    def weight_shapes(self, C: int) -> dict:
        """Each weight's name and shape, stored (in, out) (Hugging Face's `*.weight` transposed): q (or q_a,
        q_a_norm, q_b), kv_a (the latent, then the rotary key), kv_a_norm, kv_b (per head k_nope then v), o."""
        H, dqk, r = self.n_heads, self.qk_head_dim, self.q_lora_rank
        q = {"q_a.w": (C, r), "q_a_norm.w": (r,), "q_b.w": (r, H * dqk)} if r else {"q.w": (C, H * dqk)}
        return {**q, "kv_a.w": (C, self.kv_lora_rank + self.qk_rope_head_dim), "kv_a_norm.w": (self.kv_lora_rank,),
                "kv_b.w": (self.kv_lora_rank, H * (self.qk_nope_head_dim + self.v_head_dim)),
                "o.w": (H * self.v_head_dim, C)}


# The query's nope part is multiplied by the softmax scale and its rotary part rotated by tables with the scale
# folded in, so the core gets q already scaled (as the Llama attention's). The shared rotary key is rotated once,
# (B, 1, T, dr), and written into every head of k; its gradient is the sum over heads. Outputs that only element-wise
# code here reads are kept as computed (num.float32_out); the norms' outputs and the core's go to GEMMs only.
def mla_forward(xp, x, W, d: MLADims, cos, sin, num=OFF, segments=None):
    # x: (B, T, C) -> y: (B, T, C); W: name -> weight (MLADims.weight_shapes); cos, sin: (T, dr/2), or (B, T, dr/2)
    # at each row's positions (rope_tables, YaRN's attention factor folded in); segments: (B, T) document ids
    qf, kf, v, c_p = mla_project(xp, x, W, d, cos, sin, num)
    a, c_att = gqa_attention_forward(xp, qf, kf, v, num, segments)
    y, c_o = linear_forward(xp, a, W["o.w"], num=num.float32_out)
    return y, (*c_p, c_att, c_o)


def mla_project(xp, x, W, d: MLADims, cos, sin, num=OFF):
    # x: (B, T, C) -> q: (B, H, T, qk_head_dim) scaled, k: (B, H, T, qk_head_dim), v: (B, H, T, v_head_dim), cache;
    # the attention core's inputs (mla_forward's first half; a model hands them to its context's attention)
    B, T, _ = x.shape
    H, dn, dv, kvr = d.n_heads, d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank
    f32, s = num.float32_out, d.scale
    if d.q_lora_rank:
        qa, c_qa = linear_forward(xp, x, W["q_a.w"], num=f32)
        qn, c_qn = rmsnorm_forward(xp, qa, W["q_a_norm.w"], d.eps, num=num)
        del qa
        q, c_qb = linear_forward(xp, qn, W["q_b.w"], num=f32)
        c_q = (c_qa, c_qn, c_qb)
    else:
        q, c_q = linear_forward(xp, x, W["q.w"], num=f32)
    q = q.reshape(B, T, H, d.qk_head_dim)
    ckv, c_kva = linear_forward(xp, x, W["kv_a.w"], num=f32)
    lat, c_kvn = rmsnorm_forward(xp, ckv[..., :kvr], W["kv_a_norm.w"], d.eps, num=num)
    kv, c_kvb = linear_forward(xp, lat, W["kv_b.w"], num=f32)
    del lat
    kv = kv.reshape(B, T, H, dn + dv)
    qf = xp.empty((B, H, T, d.qk_head_dim), dtype=q.dtype)
    xp.multiply(q[..., :dn].transpose(0, 2, 1, 3), s, out=qf[..., :dn])
    qf[..., dn:] = rope_forward(xp, deinterleave(xp, q[..., dn:]), cos * s, sin * s, f32)
    del q
    kf = xp.empty(qf.shape, dtype=kv.dtype)
    kf[..., :dn] = kv[..., :dn].transpose(0, 2, 1, 3)
    kf[..., dn:] = rope_forward(xp, deinterleave(xp, ckv[:, :, None, kvr:]), cos, sin, f32)   # (B, 1, T, dr)
    del ckv
    v = xp.ascontiguousarray(kv[..., dn:].transpose(0, 2, 1, 3))
    return qf, kf, v, (c_q, c_kva, c_kvn, c_kvb)


def mla_backward(xp, dy, cache, W, G, d: MLADims, cos, sin, num=OFF):
    # dy: (B, T, C) -> dx: (B, T, C); G: name -> gradient views (+=); cos, sin: the forward's tables
    c_att, c_o = cache[4:]
    da = linear_backward(xp, dy, c_o, W["o.w"], G["o.w"], num=num)
    dqf, dkf, dvh = (as_float32(xp, g) for g in gqa_attention_backward(xp, da, c_att, num))
    del da
    return mla_project_backward(xp, dqf, dkf, dvh, cache[:4], W, G, d, cos, sin, num)


def mla_project_backward(xp, dqf, dkf, dvh, cache, W, G, d: MLADims, cos, sin, num=OFF):
    # dqf, dkf: (B, H, T, qk_head_dim), dvh: (B, H, T, v_head_dim), float -> dx: (B, T, C); mla_project's cache
    c_q, c_kva, c_kvn, c_kvb = cache
    B, H, T, _ = dqf.shape
    dn, dv, kvr = d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank
    f32, s = num.float32_out, d.scale
    dq = xp.empty((B, T, H, d.qk_head_dim), dtype=dqf.dtype)
    xp.multiply(dqf[..., :dn].transpose(0, 2, 1, 3), s, out=dq[..., :dn])
    interleave(xp, rope_backward(xp, xp.ascontiguousarray(dqf[..., dn:]), cos * s, sin * s, f32), out=dq[..., dn:])
    del dqf
    dkv = xp.empty((B, T, H, dn + dv), dtype=dkf.dtype)
    dkv[..., :dn] = dkf[..., :dn].transpose(0, 2, 1, 3)
    dkv[..., dn:] = dvh.transpose(0, 2, 1, 3)
    dckv = xp.empty((B, T, kvr + d.qk_rope_head_dim), dtype=dkf.dtype)
    dlat = linear_backward(xp, dkv.reshape(B, T, -1), c_kvb, W["kv_b.w"], G["kv_b.w"], num=num)
    dckv[..., :kvr] = rmsnorm_backward(xp, dlat, c_kvn, W["kv_a_norm.w"], G["kv_a_norm.w"])
    dkr = dkf[..., dn:].sum(axis=1, keepdims=True)       # the shared rotary key: the sum over every head
    interleave(xp, rope_backward(xp, dkr, cos, sin, f32)[:, :, 0], out=dckv[..., kvr:])
    del dkv, dkf, dvh, dlat
    dx = linear_backward(xp, dckv, c_kva, W["kv_a.w"], G["kv_a.w"], num=num)
    dq = dq.reshape(B, T, -1)
    if d.q_lora_rank:
        c_qa, c_qn, c_qb = c_q
        dqn = linear_backward(xp, dq, c_qb, W["q_b.w"], G["q_b.w"], num=num)
        dqa = rmsnorm_backward(xp, dqn, c_qn, W["q_a_norm.w"], G["q_a_norm.w"])
        dx += linear_backward(xp, dqa, c_qa, W["q_a.w"], G["q_a.w"], num=num)
    else:
        dx += linear_backward(xp, dq, c_q, W["q.w"], G["q.w"], num=num)
    return dx


def mla_drop_scores(cache):
    """The cache without the core's probabilities (selective recompute)."""
    return cache[:4] + (gqa_drop_scores(cache[4]),) + cache[5:]


def mla_restore_scores(xp, cache, num=OFF, segments=None):
    """A cache from mla_drop_scores with the probabilities rebuilt bit for bit (nn/gqa.py)."""
    return cache[:4] + (gqa_restore_scores(xp, cache[4], num, segments),) + cache[5:]


def mla_cache_bytes(B: int, T: int, C: int, d: MLADims, item: int, score_elements: int) -> int:
    """Bytes the forward caches for B sequences of T tokens (`item` bytes an element; score_elements: the
    probabilities kept per sequence and head, nn.attention.score_elements): the input x, the q_a norm and its
    output, the latent norm and its output (kv_b's input), the core's q and k (H x qk_head_dim), v and its output
    (H x v_head_dim, the o projection's input) and the probabilities."""
    n, H, r = B * T, d.n_heads, d.q_lora_rank
    q = (rmsnorm_cache_bytes(n, r, item) + n * r * item) if r else 0
    kv = rmsnorm_cache_bytes(n, d.kv_lora_rank, item) + n * d.kv_lora_rank * item
    core = n * H * (2 * d.qk_head_dim + 2 * d.v_head_dim) * item + B * H * score_elements * item
    return n * C * item + q + kv + core
