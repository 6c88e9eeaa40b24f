"""Incremental decoding of multi-head latent attention (nn/mla.py): a cache of the normalised latent and the rotated
rotary key per position (kv_lora_rank + qk_rope_head_dim numbers, not H per-head keys and values), attended in
the absorbed form (kv_b's key half folded into the query, its value half applied after the softmax).
"""
from __future__ import annotations

from hpengine.nn.linear import linear_forward
from hpengine.nn.mla import MLADims
from hpengine.nn.rmsnorm import rmsnorm_forward
from hpengine.nn.rope import deinterleave, rope_forward


def mla_cache_bytes_per_token(d: MLADims, n_layers: int, item: int) -> int:
    """Bytes MLA's decoding cache keeps per token over n_layers layers: the latent and the rotary key."""
    return n_layers * (d.kv_lora_rank + d.qk_rope_head_dim) * item


def expanded_cache_bytes_per_token(d: MLADims, n_layers: int, item: int) -> int:
    """Bytes a cache of the expanded per-head keys (qk_head_dim) and values (v_head_dim) would keep per token."""
    return n_layers * d.n_heads * (d.qk_head_dim + d.v_head_dim) * item


class LatentCache:
    """One layer's decoding cache: latent (T, kv_lora_rank) and rotated rotary key (T, qk_rope_head_dim); rows
    0 .. start+n-1 are filled."""

    def __init__(self, xp, T: int, d: MLADims, dtype):
        self.latent = xp.zeros((T, d.kv_lora_rank), dtype)
        self.rope_key = xp.zeros((T, d.qk_rope_head_dim), dtype)


# Scores of head h: q_nope_h . (W_uk_h^T c) + q_rot_h . k_rot = (W_uk_h q_nope_h) . c + q_rot_h . k_rot, so the
# query is taken into the latent space once per new position instead of expanding every cached position's key;
# likewise the output sum_j p_j (W_uv_h^T c_j) = W_uv_h^T (sum_j p_j c_j).
def mla_decode(xp, x, W, d: MLADims, cos, sin, cache: LatentCache, start: int):
    # x: (1, n, C) at positions start .. start+n-1; cos, sin: (n, dr/2) at those positions -> y: (1, n, C), the
    # attention's output (before the residual), as mla_forward's rows; appends the n positions to the cache
    n, H, dn, dv, kvr = x.shape[1], d.n_heads, d.qk_nope_head_dim, d.v_head_dim, d.kv_lora_rank
    s, L = d.scale, start + n
    if d.q_lora_rank:
        qa, _ = linear_forward(xp, x, W["q_a.w"])
        q, _ = linear_forward(xp, rmsnorm_forward(xp, qa, W["q_a_norm.w"], d.eps)[0], W["q_b.w"])
    else:
        q, _ = linear_forward(xp, x, W["q.w"])
    q = q.reshape(1, n, H, d.qk_head_dim)
    q_rot = rope_forward(xp, deinterleave(xp, q[..., dn:]), cos * s, sin * s)[0]           # (H, n, dr), scaled
    ckv, _ = linear_forward(xp, x[0], W["kv_a.w"])                                          # (n, kvr + dr)
    cache.latent[start:L] = rmsnorm_forward(xp, ckv[:, :kvr], W["kv_a_norm.w"], d.eps)[0]
    cache.rope_key[start:L] = rope_forward(xp, deinterleave(xp, ckv[None, :, None, kvr:]), cos, sin)[0, 0]
    wkv = W["kv_b.w"].reshape(kvr, H, dn + dv)
    q_lat = xp.einsum("nhd,chd->hnc", q[0, :, :, :dn] * s, wkv[..., :dn])                  # (H, n, kvr)
    c, kr = cache.latent[:L], cache.rope_key[:L]
    a = q_lat @ c.T + q_rot @ kr.T                                                          # (H, n, L)
    if n > 1:               # a single new position sees every cached key: nothing to mask
        a = xp.where(xp.arange(L)[None, :] > xp.arange(start, L)[:, None], -xp.inf, a)
    a -= a.max(axis=-1, keepdims=True)
    xp.exp(a, out=a)
    a /= a.sum(axis=-1, keepdims=True)
    o = xp.einsum("hnc,chv->nhv", a @ c, wkv[..., dn:]).reshape(1, n, H * dv)
    return linear_forward(xp, o, W["o.w"])[0]
