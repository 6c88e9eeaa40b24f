"""Multi-head latent attention (hpengine/nn/mla.py) and the grouped core with value heads narrower than q/k's:
forward against a naive loop written here from DeepSeek-V3's equations (interleaved rotary pairs, one rotary key
shared by the heads), backward against float64 central differences for the input and every weight, with and
without the low-rank query, under packed documents and per-token positions.
"""
import math

import numpy as np
import pytest

from hpengine.layout.cache import cache_nbytes
from hpengine.nn import score_elements
from hpengine.nn.gqa import gqa_attention_backward, gqa_attention_forward
from hpengine.nn.mla import MLADims, mla_backward, mla_cache_bytes, mla_drop_scores, mla_forward, mla_restore_scores
from hpengine.nn.mla_decode import (LatentCache, expanded_cache_bytes_per_token, mla_cache_bytes_per_token,
                                    mla_decode)
from hpengine.nn.numerics import Numerics
from hpengine.nn.rope import rope_tables
from test_layers import numgrad  # central differences (tests/unit/test_layers.py)
from test_llama_layers import assert_close_grad

THETA = 50.0


def dims(q_lora_rank=4, eps=1e-6, mscale=1.0):
    return MLADims(n_heads=2, q_lora_rank=q_lora_rank, kv_lora_rank=4, qk_nope_head_dim=3, qk_rope_head_dim=4,
                   v_head_dim=2, eps=eps, mscale=mscale)


def weights(r, d, C):
    return {n: r.standard_normal(s) * (1.0 if n.endswith("norm.w") else 1 / math.sqrt(s[0]))
            for n, s in d.weight_shapes(C).items()}


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rot_interleaved(x, pos, theta):
    # x: (..., T, dr) pairs (x[2i], x[2i+1]) turned by pos * theta^(-2i/dr); written [evens', odds'] (HF's layout)
    dr = x.shape[-1]
    out = np.empty_like(x)
    for i in range(dr // 2):
        a = pos * theta ** (-2.0 * i / dr)                    # (T,) or (B, T)
        c, s = np.cos(a), np.sin(a)
        if c.ndim == 2:                                        # per row: (B, T) against (B, H, T) or (B, T)
            c, s = (c[:, None], s[:, None]) if x.ndim == 4 else (c, s)
        x1, x2 = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., i], out[..., dr // 2 + i] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def naive_mla(x, W, d, pos, segments=None, theta=THETA):
    """DeepSeek-V3 attention one query at a time, from the equations (pos: (T,) or (B, T) positions)."""
    B, T, C = x.shape
    H, dn, dr, dv, kvr = d.n_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank
    q = _rms(x @ W["q_a.w"], W["q_a_norm.w"], d.eps) @ W["q_b.w"] if d.q_lora_rank else x @ W["q.w"]
    q = q.reshape(B, T, H, dn + dr).transpose(0, 2, 1, 3)
    ckv = x @ W["kv_a.w"]
    kv = (_rms(ckv[..., :kvr], W["kv_a_norm.w"], d.eps) @ W["kv_b.w"]).reshape(B, T, H, dn + dv).transpose(0, 2, 1, 3)
    qr = _rot_interleaved(q[..., dn:], pos, theta)              # (B, H, T, dr)
    kr = _rot_interleaved(ckv[..., kvr:], pos, theta)           # (B, T, dr): one key for every head
    scale = d.mscale / math.sqrt(dn + dr)
    o = np.zeros((B, T, H, dv))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = [u for u in range(t + 1) if segments is None or segments[b, u] == segments[b, t]]
                s = np.array([(q[b, h, t, :dn] @ kv[b, h, u, :dn] + qr[b, h, t] @ kr[b, u]) * scale for u in keys])
                p = np.exp(s - s.max())
                o[b, t, h] = (p / p.sum()) @ kv[b, h, keys, dn:]
    return o.reshape(B, T, H * dv) @ W["o.w"]


def tables(T, d, pos=None):
    cos, sin = rope_tables(np, T, d.qk_rope_head_dim, THETA, np.float64)
    return (cos, sin) if pos is None else (cos[pos], sin[pos])


@pytest.mark.parametrize("q_lora_rank", [4, 0])
@pytest.mark.parametrize("mscale", [1.0, 1.7])
def test_mla_matches_naive(q_lora_rank, mscale):
    r = np.random.default_rng(1)
    B, T, C, d = 2, 6, 6, dims(q_lora_rank, mscale=mscale)
    x, W = r.standard_normal((B, T, C)), weights(r, d, C)
    y, _ = mla_forward(np, x, W, d, *tables(T, d))
    assert y.shape == (B, T, C)
    np.testing.assert_allclose(y, naive_mla(x, W, d, np.arange(T)), rtol=1e-11, atol=1e-12)


def test_mla_documents_and_positions_match_naive_and_runs_alone():
    """Packed documents with restarting positions: each document's rows equal it run alone from position 0."""
    r = np.random.default_rng(2)
    B, T, C, d = 2, 7, 6, dims()
    x, W = r.standard_normal((B, T, C)), weights(r, d, C)
    seg = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]])
    pos = np.array([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    y, _ = mla_forward(np, x, W, d, *tables(T, d, pos), segments=seg)
    np.testing.assert_allclose(y, naive_mla(x, W, d, pos, seg), rtol=1e-11, atol=1e-12)
    for b, (a, e) in [(0, (0, 3)), (0, (3, 7)), (1, (0, 5)), (1, (5, 7))]:
        alone, _ = mla_forward(np, x[b:b + 1, a:e], W, d, *tables(e - a, d))
        np.testing.assert_allclose(y[b:b + 1, a:e], alone, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("q_lora_rank,documents", [(4, False), (0, False), (4, True), (0, True)])
def test_mla_fd_every_input_and_weight(q_lora_rank, documents):
    r = np.random.default_rng(3)
    B, T, C, d = 2, 5, 6, dims(q_lora_rank, eps=0.05, mscale=1.3)
    x, W = r.standard_normal((B, T, C)), weights(r, d, C)
    seg = np.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]]) if documents else None
    pos = np.array([[0, 1, 0, 1, 2], [0, 1, 2, 3, 0]]) if documents else None
    cos, sin = tables(T, d, pos)
    ry = r.standard_normal((B, T, C))
    saved = {n: a.copy() for n, a in W.items()}, x.copy()
    y, cache = mla_forward(np, x, W, d, cos, sin, segments=seg)
    G = {n: np.zeros_like(a) for n, a in W.items()}
    dx = mla_backward(np, ry, cache, W, G, d, cos, sin)
    for n in W:                     # neither pass writes into its inputs
        np.testing.assert_array_equal(W[n], saved[0][n])
    np.testing.assert_array_equal(x, saved[1])
    f = lambda: np.sum(mla_forward(np, x, W, d, cos, sin, segments=seg)[0] * ry)
    assert_close_grad(numgrad(f, x), dx, "mla dx")
    for n in W:
        assert_close_grad(numgrad(f, W[n]), G[n], f"mla d{n}")
    G2 = {n: np.full_like(a, 0.5) for n, a in W.items()}       # backward adds into the gradients it is handed
    mla_backward(np, ry, mla_forward(np, x, W, d, cos, sin, segments=seg)[1], W, G2, d, cos, sin)
    for n in W:
        np.testing.assert_allclose(G2[n], G[n] + 0.5, rtol=1e-13, atol=1e-13)


def test_mla_drop_restore_scores_and_cache_bytes():
    r = np.random.default_rng(4)
    B, T, C = 2, 6, 6
    for d in (dims(4), dims(0)):
        x, W = r.standard_normal((B, T, C)), weights(r, d, C)
        cos, sin = tables(T, d)
        ry = r.standard_normal((B, T, C))
        y, cache = mla_forward(np, x, W, d, cos, sin)
        skip = {id(a) for a in W.values()}
        assert cache_nbytes(cache, skip) == mla_cache_bytes(B, T, C, d, 8, score_elements(T))
        G1, G2 = ({n: np.zeros_like(a) for n, a in W.items()} for _ in range(2))
        dx1 = mla_backward(np, ry, cache, W, G1, d, cos, sin)
        restored = mla_restore_scores(np, mla_drop_scores(cache))
        dx2 = mla_backward(np, ry, restored, W, G2, d, cos, sin)
        np.testing.assert_array_equal(dx1, dx2)
        for n in W:
            np.testing.assert_array_equal(G1[n], G2[n])


def test_mla_float32_stays_float32():
    r = np.random.default_rng(5)
    B, T, C, d = 1, 4, 6, dims()
    x = r.standard_normal((B, T, C)).astype(np.float32)
    W = {n: a.astype(np.float32) for n, a in weights(r, d, C).items()}
    cos, sin = rope_tables(np, T, d.qk_rope_head_dim, THETA, np.float32)
    y, cache = mla_forward(np, x, W, d, cos, sin)
    G = {n: np.zeros_like(a) for n, a in W.items()}
    dx = mla_backward(np, np.ones_like(y), cache, W, G, d, cos, sin)
    assert y.dtype == dx.dtype == np.float32 and all(g.dtype == np.float32 for g in G.values())
    W64 = {n: a.astype(np.float64) for n, a in W.items()}
    y64, _ = mla_forward(np, x.astype(np.float64), W64, d, *tables(T, d))
    np.testing.assert_allclose(y, y64, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------- grouped core, value heads narrower than q/k heads

def naive_attention(q, k, v):
    B, H, T, _ = q.shape
    g = H // k.shape[1]
    y = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                s = k[b, h // g, : t + 1] @ q[b, h, t]
                p = np.exp(s - s.max())
                y[b, t, h] = (p / p.sum()) @ v[b, h // g, : t + 1]
    return y.reshape(B, T, -1)


@pytest.mark.parametrize("H,K,hd,dv", [(2, 2, 5, 3), (4, 2, 3, 6), (3, 1, 4, 1)])
def test_gqa_value_width_differs(H, K, hd, dv):
    r = np.random.default_rng(6)
    B, T = 2, 5
    q, k, v = r.standard_normal((B, H, T, hd)), r.standard_normal((B, K, T, hd)), r.standard_normal((B, K, T, dv))
    y, cache = gqa_attention_forward(np, q, k, v)
    assert y.shape == (B, T, H * dv)
    np.testing.assert_allclose(y, naive_attention(q, k, v), rtol=1e-12, atol=1e-13)
    ry = r.standard_normal(y.shape)
    grads = gqa_attention_backward(np, ry, cache)
    f = lambda: np.sum(gqa_attention_forward(np, q, k, v)[0] * ry)
    for a, g, name in zip((q, k, v), grads, "qkv"):
        assert g.shape == a.shape
        assert_close_grad(numgrad(f, a), g, f"gqa d{name}")


# ------------------------------------------------------------------------------ decoding

@pytest.mark.parametrize("q_lora_rank", [4, 0])
def test_mla_decode_equals_forward_and_caches_the_latent(q_lora_rank):
    """A prompt of 3 positions, then one position at a time: each step's rows equal the full forward's."""
    r = np.random.default_rng(8)
    T, C, d = 7, 6, dims(q_lora_rank, mscale=1.2)
    x, W = r.standard_normal((1, T, C)), weights(r, d, C)
    cos, sin = tables(T, d)
    want, _ = mla_forward(np, x, W, d, cos, sin)
    cache = LatentCache(np, T, d, np.float64)
    got = [mla_decode(np, x[:, :3], W, d, cos[:3], sin[:3], cache, 0)]
    got += [mla_decode(np, x[:, t:t + 1], W, d, cos[t:t + 1], sin[t:t + 1], cache, t) for t in range(3, T)]
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=1e-11, atol=1e-12)
    # the cache holds the latent and the rotary key only: (4 + 4) numbers per position, not 2 heads x (7 + 2)
    assert cache.latent.nbytes + cache.rope_key.nbytes == T * mla_cache_bytes_per_token(d, 1, 8) == T * 8 * 8
    assert expanded_cache_bytes_per_token(d, 1, 8) == 2 * (7 + 2) * 8
    assert mla_cache_bytes_per_token(d, 61, 2) == 61 * 8 * 2


def test_cache_bytes_deepseek_v3():
    """DeepSeek-V3 (61 layers, 128 heads, kv_lora_rank 512, rope key 64, q/k 192 and v 128 wide) in bfloat16:
    70,272 bytes per token against 4,997,120 for expanded keys and values."""
    d = MLADims(n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128)
    assert mla_cache_bytes_per_token(d, 61, 2) == 70272
    assert expanded_cache_bytes_per_token(d, 61, 2) == 4997120


@pytest.mark.parametrize("bits", [False, True])
def test_mla_under_bf16_operands_stays_near_float32(bits):
    """num= reaches every GEMM and the core: bfloat16 operands move the results by about bfloat16's precision
    (not zero: the policy took effect), and packed bits come back as float32 outputs and gradients."""
    r = np.random.default_rng(9)
    B, T, C, d = 2, 6, 6, dims(4)
    x = r.standard_normal((B, T, C)).astype(np.float32)
    W = {n: a.astype(np.float32) for n, a in weights(r, d, C).items()}
    cos, sin = (a.astype(np.float32) for a in tables(T, d))
    dy = r.standard_normal((B, T, C)).astype(np.float32)
    out = []
    for num in (Numerics(), Numerics(bf16=True, bits=bits)):
        y, cache = mla_forward(np, x, W, d, cos, sin, num=num)
        G = {n: np.zeros_like(a) for n, a in W.items()}
        dx = mla_backward(np, dy, cache, W, G, d, cos, sin, num=num)
        assert y.dtype == dx.dtype == np.float32
        out.append([y, dx] + [G[n] for n in sorted(G)])
    for a, b in zip(*out):
        err = np.abs(a - b).max() / np.abs(a).max()
        assert 1e-5 < err < 5e-2, err
