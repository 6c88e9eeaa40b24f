"""The fused layer kernels (kernels/fused.cu through hpengine/nn/fused.py) against their NumPy twins, the
layers' NumPy code: forward outputs, caches and backward results, in float64 and float32, over row lengths
that are not multiples of a warp and causal blocks of any size. Skips cleanly without CuPy and a device.
"""
from __future__ import annotations

import numpy as np
import pytest

from hpengine.device import backend
from hpengine.device.bf16_bits import bf16_bits_numpy, from_bf16_bits, to_bf16_bits
from hpengine.nn import (attention_backward, attention_forward, cross_entropy_backward, cross_entropy_forward,
                         fused, gelu_backward, gelu_forward, layernorm_backward, layernorm_forward)

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")
cp = backend.cupy_module() if backend.cupy_usable() else None
TOL = {np.float64: 1e-11, np.float32: 3e-5}


def close(dev, host, dtype):
    got, want = cp.asnumpy(dev), np.asarray(host)
    assert got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(got - want).max() <= TOL[dtype] * scale


def pair(rng, shape, dtype, scale=1.0):
    a = (rng.standard_normal(shape) * scale).astype(dtype)
    return a, cp.asarray(a)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(3, 5), (2, 7, 768), (1000,)])
def test_gelu(dtype, shape):
    rng = np.random.default_rng(1)
    x, xd = pair(rng, shape, dtype, 3.0)
    y, c = gelu_forward(np, x)
    yd, cd = gelu_forward(cp, xd)
    close(yd, y, dtype)
    close(cd[1], c[1], dtype)
    dy, dyd = pair(rng, shape, dtype)
    close(gelu_backward(cp, dyd, cd), gelu_backward(np, dy, c), dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("C", [7, 96, 768, 1500])
def test_layernorm(dtype, C):
    rng = np.random.default_rng(2)
    x, xd = pair(rng, (3, 5, C), dtype, 2.0)
    w, wd = pair(rng, (C,), dtype)
    b, bd = pair(rng, (C,), dtype)
    y, c = layernorm_forward(np, x + 1.5, w, b)
    yd, cd = layernorm_forward(cp, xd + 1.5, wd, bd)
    close(yd, y, dtype)
    close(cd[0], c[0], dtype)
    close(cd[1], c[1], dtype)
    dy, dyd = pair(rng, x.shape, dtype)
    dw, db = np.zeros(C, dtype), np.zeros(C, dtype)
    dwd, dbd = cp.zeros(C, dtype), cp.zeros(C, dtype)
    close(layernorm_backward(cp, dyd, cd, wd, dwd, dbd), layernorm_backward(np, dy, c, w, dw, db), dtype)
    close(dwd, dw, dtype)
    close(dbd, db, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("B,T,H,hd", [(2, 5, 3, 4), (1, 33, 2, 8), (2, 128, 4, 16)])
def test_attention(dtype, B, T, H, hd):
    rng = np.random.default_rng(3)
    qkv, qkvd = pair(rng, (B, T, 3 * H * hd), dtype)
    y, c = attention_forward(np, qkv, H)
    yd, cd = attention_forward(cp, qkvd, H)
    close(yd, y, dtype)
    for pd, p in zip(cd[2], c[2]):
        close(pd, p, dtype)                    # the masked probabilities are exact zeros on both
    dy, dyd = pair(rng, y.shape, dtype)
    close(attention_backward(cp, dyd, cd), attention_backward(np, dy, c), dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("V", [5, 256, 50304])
def test_cross_entropy(dtype, V):
    rng = np.random.default_rng(4)
    z, zd = pair(rng, (2, 9, V), dtype, 4.0)
    t = rng.integers(0, V, (2, 9))
    loss, c = cross_entropy_forward(np, z, t, 18)
    lossd, cd = cross_entropy_forward(cp, zd, cp.asarray(t), 18)
    close(lossd, loss, dtype)
    close(cd[0], c[0], dtype)
    close(cross_entropy_backward(cp, cd, 3.0), cross_entropy_backward(np, c, 3.0), dtype)


def test_switch_off_takes_the_cupy_twin(monkeypatch):
    rng = np.random.default_rng(5)
    x, xd = pair(rng, (4, 64), np.float64)
    on = gelu_forward(cp, xd)[0]
    monkeypatch.setattr(fused, "ENABLED", False)
    assert not fused.usable(cp, xd)
    close(gelu_forward(cp, xd)[0], cp.asnumpy(on), np.float64)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("accumulate", [False, True])
def test_strided_gemm_on_attention_views(monkeypatch, dtype, accumulate):
    from hpengine.nn import gemm
    monkeypatch.setattr(gemm, "MAX_LOOPED_CALLS", 10**6)      # the strided path however many calls
    rng = np.random.default_rng(6)
    B, T, H, hd = 3, 10, 2, 8
    qkv = rng.standard_normal((B, T, 3 * H * hd)).astype(dtype)
    y = rng.standard_normal((B, T, H * hd)).astype(dtype)
    dev = {"qkv": cp.asarray(qkv), "y": cp.asarray(y)}

    def heads(a, parts):
        v = a.reshape(B, T, H, parts, -1)
        return [v[:, :, :, i].transpose(0, 2, 1, 3) for i in range(parts)]
    for xp, arrs in ((np, {"qkv": qkv, "y": y.copy()}), (cp, dev)):
        q, k, v = heads(arrs["qkv"], 3)
        (o,) = heads(arrs["y"], 1)
        p = xp.matmul(q[:, :, 4:], k.swapaxes(-1, -2)) if xp is np else gemm.matmul(cp, q[:, :, 4:], k.swapaxes(-1, -2))
        if xp is np:
            out = o[:, :, 4:]
            if accumulate:
                out += p @ v
            else:
                np.matmul(p, v, out=out)
            want_p, want_y = p, arrs["y"]
        else:
            gemm.matmul(cp, p, v, o[:, :, 4:], accumulate)
            close(p, want_p, dtype)
            close(arrs["y"], want_y, dtype)
            assert gemm._works(cp, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rows", [1, 37, 5000])
def test_linear_backward_accumulates(dtype, rows):
    from hpengine.nn import linear_backward, linear_forward
    rng = np.random.default_rng(7)
    x, xd = pair(rng, (rows, 48), dtype)
    w, wd = pair(rng, (48, 70), dtype)
    b, bd = pair(rng, (70,), dtype)
    dw0, dwd = pair(rng, (48, 70), dtype)            # gradients already hold a micro-batch's sum
    db0, dbd = pair(rng, (70,), dtype)
    _, c = linear_forward(np, x, w, b)
    _, cd = linear_forward(cp, xd, wd, bd)
    dy, dyd = pair(rng, (rows, 70), dtype)
    close(linear_backward(cp, dyd, cd, wd, dwd, dbd), linear_backward(np, dy, c, w, dw0, db0), dtype)
    close(dwd, dw0, dtype)
    close(dbd, db0, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rows,C", [(15, 7), (37, 96), (5, 1500)])
def test_rmsnorm(entries, dtype, rows, C):
    from hpengine.nn.rmsnorm import rmsnorm_backward, rmsnorm_forward
    rng = np.random.default_rng(8)
    x, xd = pair(rng, (rows, 1, C), dtype, 2.0)
    w, wd = pair(rng, (C,), dtype)
    y, c = rmsnorm_forward(np, x, w)
    yd, cd = rmsnorm_forward(cp, xd, wd)
    close(yd, y, dtype)
    close(cd[0], c[0], dtype)
    close(cd[1], c[1], dtype)
    dy, dyd = pair(rng, x.shape, dtype)
    dw, dwd = np.zeros(C, dtype), cp.zeros(C, dtype)
    close(rmsnorm_backward(cp, dyd, cd, wd, dwd), rmsnorm_backward(np, dy, c, w, dw), dtype)
    close(dwd, dw, dtype)
    assert {"rmsnorm_fwd", "rmsnorm_bwd"} <= entries


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("B,T,H,hd", [(2, 7, 3, 6), (1, 33, 2, 64)])
def test_rope(entries, dtype, B, T, H, hd):
    from hpengine.nn.rope import rope_backward, rope_forward, rope_tables
    rng = np.random.default_rng(9)
    proj, projd = pair(rng, (B, T, 2 * H * hd), dtype)       # x is the second half: a strided view
    tables = [rope_tables(xp, T + 3, hd, 10000.0, dtype, 0.5) for xp in (np, cp)]
    x, xd = (a[:, :, H * hd:].reshape(B, T, H, hd) for a in (proj, projd))
    yd = rope_forward(cp, xd, *tables[1])
    assert yd.flags.c_contiguous
    close(yd, rope_forward(np, x, *tables[0]), dtype)
    dy, dyd = pair(rng, (B, H, T, hd), dtype)
    dxd = rope_backward(cp, dyd, *tables[1])
    assert dxd.flags.c_contiguous
    close(dxd, rope_backward(np, dy, *tables[0]), dtype)
    dyt, dytd = (a.reshape(B, T, H, hd).transpose(0, 2, 1, 3) for a in (dy, dyd))     # strided dy
    close(rope_backward(cp, dytd, *tables[1]), rope_backward(np, dyt, *tables[0]), dtype)
    assert {"rope_fwd", "rope_bwd"} <= entries


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(3, 5), (2, 7, 300)])
def test_swiglu(entries, dtype, shape):
    from hpengine.nn.swiglu import swiglu_backward, swiglu_forward, swiglu_recompute
    rng = np.random.default_rng(10)
    g, gd = pair(rng, shape, dtype, 3.0)
    u, ud = pair(rng, shape, dtype)
    a, c = swiglu_forward(np, g, u)
    ad, cd = swiglu_forward(cp, gd, ud)
    close(ad, a, dtype)
    close(cd[2], c[2], dtype)
    assert cp.asnumpy(swiglu_recompute(cp, cd)).tobytes() == cp.asnumpy(ad).tobytes()
    da, dad = pair(rng, shape, dtype)
    for got, want in zip(swiglu_backward(cp, dad, cd), swiglu_backward(np, da, c)):
        close(got, want, dtype)
    assert {"swiglu_fwd", "swiglu_bwd"} <= entries


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("B,T,H,K,hd", [(2, 7, 6, 2, 6), (1, 33, 4, 1, 8), (2, 16, 4, 4, 8)])
def test_gqa_attention(entries, dtype, B, T, H, K, hd):
    from hpengine.nn.gqa import gqa_attention_backward, gqa_attention_forward
    rng = np.random.default_rng(11)
    (q, qd), (k, kd), (v, vd) = pair(rng, (B, H, T, hd), dtype), pair(rng, (B, K, T, hd), dtype), \
        pair(rng, (B, K, T, hd), dtype)
    y, c = gqa_attention_forward(np, q, k, v)
    yd, cd = gqa_attention_forward(cp, qd, kd, vd)
    close(yd, y, dtype)
    for pd, p in zip(cd[3], c[3]):
        close(pd, p, dtype)
    dy, dyd = pair(rng, y.shape, dtype)
    for got, want in zip(gqa_attention_backward(cp, dyd, cd), gqa_attention_backward(np, dy, c)):
        close(got, want, dtype)
    assert {"causal_softmax", "grouped_softmax_bwd"} <= entries


# ---------------------------------------------------------------- bfloat16-bits entries (<op>_f32_bf16, _bf16i)

def close_bits(bits, host, f32=None):
    """Bits from an _f32_bf16 entry: their values within a bfloat16 rounding (2^-8 relative) and float32 noise of
    the NumPy twin's `host`; with f32 (the _f32 entry's output on the same inputs) equal to its rounding by
    TO_BF16_BODY (bf16_bits.to_bf16_bits), or one bfloat16 step away where the two entries' float32 code
    contracts or unrolls differently (the stand-in computes both alike: equal there)."""
    assert bits.dtype == np.uint16 and bits.shape == np.shape(host)
    got = cp.asnumpy(from_bf16_bits(cp, bits)).astype(np.float64)
    want = np.asarray(host, np.float64)
    assert (np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + TOL[np.float32] * max(1.0, np.abs(want).max())).all()
    if f32 is not None:
        ref = cp.asnumpy(from_bf16_bits(cp, to_bf16_bits(cp, f32))).astype(np.float64)
        step = np.abs(got - ref) <= 2.0 ** -7 * np.maximum(np.abs(got), np.abs(ref))
        assert step.all() and (got == ref).mean() >= 0.99


def same_f32(dev, other_dev, host):
    """A float32 side output of a bits entry: the _f32 entry's (bit for bit on the stand-in), the twin's to TOL."""
    close(dev, host, np.float32)
    close(dev, cp.asnumpy(other_dev), np.float32)


@pytest.mark.parametrize("shape", [(3, 5), (2, 7, 300)])
def test_gelu_swiglu_bits(entries, shape):
    from hpengine.nn.swiglu import swiglu_backward, swiglu_forward
    rng = np.random.default_rng(12)
    x, xd = pair(rng, shape, np.float32, 3.0)
    y, c = gelu_forward(np, x)
    yd, sd = fused.gelu_forward(cp, xd)
    yb, sb = fused.gelu_forward(cp, xd, bits=True)
    close_bits(yb, y, yd)
    same_f32(sb, sd, c[1])
    g, gd = pair(rng, shape, np.float32, 3.0)
    u, ud = pair(rng, shape, np.float32)
    a, c = swiglu_forward(np, g, u)
    ad, sd = fused.swiglu_forward(cp, gd, ud)
    ab, sb = fused.swiglu_forward(cp, gd, ud, bits=True)
    close_bits(ab, a, ad)
    same_f32(sb, sd, c[2])
    da, dad = pair(rng, shape, np.float32)
    want = swiglu_backward(np, da, c)
    f32 = fused.swiglu_backward(cp, gd, ud, sd, dad)
    for got, w, ref in zip(fused.swiglu_backward(cp, gd, ud, sd, dad, bits=True), want, f32):
        close_bits(got, w, ref)
    assert {"gelu_fwd_bf16", "swiglu_fwd_bf16", "swiglu_bwd_bf16"} <= entries


@pytest.mark.parametrize("rows,C", [(15, 7), (37, 96), (5, 1500)])
def test_norm_bits(entries, rows, C):
    from hpengine.nn.rmsnorm import rmsnorm_forward
    rng = np.random.default_rng(13)
    x, xd = pair(rng, (rows, C), np.float32, 2.0)
    w, wd = pair(rng, (C,), np.float32)
    b, bd = pair(rng, (C,), np.float32)
    y, c = layernorm_forward(np, x + np.float32(1.5), w, b)
    f32 = fused.layernorm_forward(cp, xd + np.float32(1.5), wd, bd, 1e-5)
    yb, xhat, rstd = fused.layernorm_forward(cp, xd + np.float32(1.5), wd, bd, 1e-5, bits=True)
    close_bits(yb, y, f32[0])
    same_f32(xhat, f32[1], c[0])
    same_f32(rstd, f32[2], c[1])
    y, c = rmsnorm_forward(np, x, w)
    f32 = fused.rmsnorm_forward(cp, xd, wd, 1e-5)
    yb, xhat, rstd = fused.rmsnorm_forward(cp, xd, wd, 1e-5, bits=True)
    close_bits(yb, y, f32[0])
    same_f32(xhat, f32[1], c[0])
    same_f32(rstd, f32[2], c[1])
    assert {"layernorm_fwd_bf16", "rmsnorm_fwd_bf16"} <= entries


@pytest.mark.parametrize("n_q,T,q0", [(5, 5, 0), (7, 40, 33), (64, 200, 100)])
def test_causal_softmax_bits_and_its_gradients(entries, n_q, T, q0):
    rng = np.random.default_rng(14)
    z, zd = pair(rng, (2, 3, n_q, T), np.float32, 3.0)
    mask = np.arange(T) <= q0 + np.arange(n_q)[:, None]
    zm = np.where(mask, z, -np.inf)
    e = np.exp(zm - zm.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    p32 = zd.copy()
    fused.causal_softmax_(p32, q0)
    pb = fused.causal_softmax_bits(cp, zd, q0)
    close_bits(pb, p, p32)
    assert (cp.asnumpy(pb)[..., ~mask] == 0).all()                 # the masked keys: exact zeros
    assert cp.asnumpy(zd).tobytes() == z.tobytes()
    pf = cp.asnumpy(from_bf16_bits(cp, pb))                        # the values the bits hold
    ds, dsd = pair(rng, z.shape, np.float32)
    rs, rsd = pair(rng, (2, 3, q0 + n_q, 1), np.float32)
    for bits in (False, True):
        d = dsd.copy()
        fused.softmax_backward_(d, pb if bits else cp.asarray(pf), rsd, q0)
        close(d, (ds - rs[:, :, q0:q0 + n_q]) * pf, np.float32)
        d = dsd.copy()
        fused.grouped_softmax_backward_(d, pb if bits else cp.asarray(pf), rsd[:, :, q0:q0 + n_q].copy())
        close(d, (ds - rs[:, :, q0:q0 + n_q]) * pf, np.float32)
    assert {"causal_softmax_bf16", "softmax_bwd_bf16", "grouped_softmax_bwd_bf16"} <= entries


def test_bits_rounding_is_to_bf16_body():
    """The kernels' rounding against TO_BF16_BODY's ElementwiseKernel on the same float32 values: g = 2^14
    saturates the gate, so swiglu's a = 2^14 u exactly; ties, overflow to inf and inf round alike; a NaN stays
    a NaN."""
    rng = np.random.default_rng(15)
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F808001, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,
                     0xFF7FFFFF, 0x7F800000, 0xFF800000], np.uint32).view(np.float32)
    spread = (rng.standard_normal(20000) * 2.0 ** rng.integers(-60, 60, 20000)).astype(np.float32)
    a = np.concatenate([ties, spread, np.array([np.nan], np.float32)])
    u = cp.asarray(a * np.float32(2.0 ** -14))
    out, s = fused.swiglu_forward(cp, cp.full(a.shape, 2.0 ** 14, dtype=np.float32), u, bits=True)
    assert (cp.asnumpy(s) == 1).all()
    got, want = cp.asnumpy(out), cp.asnumpy(to_bf16_bits(cp, cp.asarray(a)))
    assert (got[:-1] == want[:-1]).all()
    assert got[-1] & 0x7F80 == 0x7F80 and got[-1] & 0x7F


@pytest.mark.parametrize("B,T,H,hd", [(2, 7, 3, 6), (1, 33, 2, 64)])
def test_rope_bits(entries, B, T, H, hd):
    """Rotations written as bits, and read from a bits projection through its strided (B, T, H, hd) view."""
    from hpengine.nn.rope import rope_backward, rope_forward, rope_tables
    rng = np.random.default_rng(16)
    proj, projd = pair(rng, (B, T, 2 * H * hd), np.float32)
    tables = [rope_tables(xp, T + 3, hd, 10000.0, np.float32, 0.5) for xp in (np, cp)]

    def heads(a):
        return a[:, :, H * hd:].reshape(B, T, H, hd)
    f32 = fused.rope_forward(cp, heads(projd), *tables[1])
    close_bits(fused.rope_forward(cp, heads(projd), *tables[1], bits=True), rope_forward(np, heads(proj), *tables[0]),
               f32)
    pb = to_bf16_bits(cp, projd)
    pv = from_bf16_bits(cp, pb)
    want = rope_forward(np, heads(cp.asnumpy(pv)), *tables[0])
    close_bits(fused.rope_forward(cp, heads(pb), *tables[1]), want, fused.rope_forward(cp, heads(pv), *tables[1]))
    dy, dyd = pair(rng, (B, T, H, hd), np.float32)
    dyt, dytd = (a.transpose(0, 2, 1, 3) for a in (dy, dyd))                # strided (B, H, T, hd)
    close_bits(fused.rope_backward(cp, dytd, *tables[1], bits=True), rope_backward(np, dyt, *tables[0]),
               fused.rope_backward(cp, dytd, *tables[1]))
    assert {"rope_fwd_bf16", "rope_bwd_bf16", "rope_fwd_bf16i"} <= entries


@pytest.mark.parametrize("shape", [(3, 5), (2, 7, 300)])
def test_gelu_swiglu_read_bits(entries, shape):
    """Inputs as bits: the cache s within a rounding of the twin's (and of the float32 entry's, rounded); the
    forward's output equal to the rounding of NumPy's product on the values of the inputs and of s's bits (exact in
    float32: bfloat16 significands), and to the recompute entry's; the backwards against the twin on those values."""
    from hpengine.nn.swiglu import swiglu_backward, swiglu_forward, swiglu_recompute
    rng = np.random.default_rng(17)

    def bits_pair(scale=1.0):
        b = to_bf16_bits(cp, cp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)))
        return b, from_bf16_bits(cp, b)
    xb, xv = bits_pair(3.0)
    x = cp.asnumpy(xv)
    _, c = gelu_forward(np, x)
    yb, sb = fused.gelu_forward(cp, xb)
    close_bits(sb, c[1], fused.gelu_forward(cp, xv)[1])
    sv = cp.asnumpy(from_bf16_bits(cp, sb))
    assert (cp.asnumpy(yb) == bf16_bits_numpy(x * sv)).all()
    assert cp.asnumpy(fused.gelu_recompute(cp, xb, sb)).tobytes() == cp.asnumpy(yb).tobytes()
    dy, dyd = pair(rng, shape, np.float32)
    dx = fused.gelu_backward(cp, xb, sb, dyd)                       # bits: only GEMMs read it
    close_bits(dx, gelu_backward(np, dy, (x, sv)), fused.gelu_backward(cp, xv, cp.asarray(sv), dyd))
    (gb, gv), (ub, uv) = bits_pair(3.0), bits_pair()
    g, u = cp.asnumpy(gv), cp.asnumpy(uv)
    _, c = swiglu_forward(np, g, u)
    ab, sb = fused.swiglu_forward(cp, gb, ub)
    close_bits(sb, c[2], fused.swiglu_forward(cp, gv, uv)[1])
    sv = cp.asnumpy(from_bf16_bits(cp, sb))
    assert (cp.asnumpy(ab) == bf16_bits_numpy(swiglu_recompute(np, (g, u, sv)))).all()
    assert cp.asnumpy(fused.swiglu_recompute(cp, gb, ub, sb)).tobytes() == cp.asnumpy(ab).tobytes()
    da, dad = pair(rng, shape, np.float32)
    f32 = fused.swiglu_backward(cp, gv, uv, cp.asarray(sv), dad)
    for got, w, ref in zip(fused.swiglu_backward(cp, gb, ub, sb, dad), swiglu_backward(np, da, (g, u, sv)), f32):
        close_bits(got, w, ref)
    assert {"gelu_fwd_bf16i", "gelu_bwd_bf16i", "gelu_recompute_bf16i", "swiglu_fwd_bf16i", "swiglu_bwd_bf16i",
            "swiglu_recompute_bf16i"} <= entries
