"""The fused kernels' bfloat16-bits outputs (<op>_f32_bf16 of kernels/fused.cu) on the CuPy stand-in, launched
through hpengine/nn/fused.py: each float32 entry first against its closed form (float32 tolerance), then the bits
entry's output equal, bit for bit, to ml_dtypes' bfloat16 of that entry's float32 output (nearest, ties to even:
an oracle independent of the stand-in's rounding), its float32 side outputs equal to the float32 entry's, and the
softmax backwards reading bits equal to the float32 entry on the values the bits hold. Ties, overflow to inf, inf
and NaN through the gating entry, whose output is an exact multiple of its input there. (The entries that read
bits too, <op>_f32_bf16i: test_fused_bits_inputs.py.)"""
from __future__ import annotations

import emulated_cupy
import numpy as np
import pytest
from bits_helpers import bf16 as _bf16
from bits_helpers import dev as _dev
from bits_helpers import host as _host
from bits_helpers import same_bits as _same_bits

from hpengine.device.bf16_bits import from_bf16_bits
from hpengine.nn import fused

F32 = {"rtol": 2e-6, "atol": 2e-6}
RNG = np.random.default_rng(11)


@pytest.fixture(autouse=True)
def rng(monkeypatch):
    monkeypatch.setitem(globals(), "RNG", np.random.default_rng(11))


@pytest.fixture
def device(monkeypatch):
    return emulated_cupy.install(monkeypatch)


def _normal(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _same(a, b):
    assert _host(a).tobytes() == _host(b).tobytes()


# ---------------------------------------------------------------- outputs as bits

def test_gelu_and_gating_forwards(device):
    x, g, u = _normal(4, 37, scale=2.0), _normal(4, 37, scale=3.0), _normal(4, 37)
    xd, gd, ud = (_dev(device, a) for a in (x, g, u))
    y, s = fused.gelu_forward(device, xd)
    x64 = x.astype(np.float64)
    want = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)))
    np.testing.assert_allclose(_host(y), want, **F32)
    yb, sb = fused.gelu_forward(device, xd, bits=True)
    _same_bits(yb, y)
    _same(sb, s)
    a, s = fused.swiglu_forward(device, gd, ud)
    g64 = g.astype(np.float64)
    np.testing.assert_allclose(_host(a), g64 / (1 + np.exp(-g64)) * u, **F32)
    ab, sb = fused.swiglu_forward(device, gd, ud, bits=True)
    _same_bits(ab, a)
    _same(sb, s)
    assert {"gelu_fwd_f32_bf16", "swiglu_fwd_f32_bf16"} <= set(device.launches)


def test_gating_backward(device):
    g, u, da = _normal(3, 41, scale=3.0), _normal(3, 41), _normal(3, 41)
    gd, ud, dad = (_dev(device, a) for a in (g, u, da))
    _, s = fused.swiglu_forward(device, gd, ud)
    dg, du = fused.swiglu_backward(device, gd, ud, s, dad)
    g64 = g.astype(np.float64)
    sig = 1 / (1 + np.exp(-g64))
    np.testing.assert_allclose(_host(du), g64 * sig * da, **F32)
    np.testing.assert_allclose(_host(dg), (sig + g64 * sig * (1 - sig)) * u * da, **F32)
    dgb, dub = fused.swiglu_backward(device, gd, ud, s, dad, bits=True)
    _same_bits(dgb, dg)
    _same_bits(dub, du)
    assert "swiglu_bwd_f32_bf16" in device.launches


def test_norm_forwards(device):
    x = _normal(6, 45, scale=2.0) + np.float32(0.3)
    w, b = _normal(45), _normal(45)
    xd, wd, bd = (_dev(device, a) for a in (x, w, b))
    x64 = x.astype(np.float64)
    y, xhat, rstd = fused.layernorm_forward(device, xd, wd, bd, 1e-5)
    want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(_host(y), want, rtol=1e-5, atol=1e-5)
    yb, xhb, rsb = fused.layernorm_forward(device, xd, wd, bd, 1e-5, bits=True)
    _same_bits(yb, y)
    _same(xhb, xhat)
    _same(rsb, rstd)
    y, xhat, rstd = fused.rmsnorm_forward(device, xd, wd, 1e-5)
    np.testing.assert_allclose(_host(y), x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * w,
                               rtol=1e-5, atol=1e-5)
    yb, xhb, rsb = fused.rmsnorm_forward(device, xd, wd, 1e-5, bits=True)
    _same_bits(yb, y)
    _same(xhb, xhat)
    _same(rsb, rstd)
    assert {"layernorm_fwd_f32_bf16", "rmsnorm_fwd_f32_bf16"} <= set(device.launches)


@pytest.mark.parametrize("q0", [0, 5])
def test_causal_softmax_bits(device, q0):
    n_q, n_cols = 4, 9
    z = _normal(2, 3, n_q, n_cols, scale=3.0)
    mask = np.arange(n_cols) <= q0 + np.arange(n_q)[:, None]
    z64 = z.astype(np.float64)
    e = np.where(mask, np.exp(z64 - np.where(mask, z64, -np.inf).max(-1, keepdims=True)), 0)
    p32 = _dev(device, z)
    fused.causal_softmax_(p32, q0)
    np.testing.assert_allclose(_host(p32), e / e.sum(-1, keepdims=True), **F32)
    zd = _dev(device, z)
    pb = fused.causal_softmax_bits(device, zd, q0)
    _same_bits(pb, p32)
    assert (_host(pb)[..., ~mask] == 0).all() and (_host(pb)[..., mask] != 0).all()
    assert _host(zd).tobytes() == z.tobytes()                       # not in place
    assert "causal_softmax_f32_bf16" in device.launches
    if q0:
        with pytest.raises(AssertionError, match="keys of rows of 9"):
            fused.causal_softmax_bits(device, zd, q0 + 1)


def _rotated(x, ang, sign):
    """x (..., hd) with each pair (x[k], x[k + hd/2]) turned by sign * ang (..., hd/2), in float64."""
    h = x.shape[-1] // 2
    z = (x[..., :h].astype(np.float64) + 1j * x[..., h:]) * np.exp(sign * 1j * ang)
    return np.concatenate([z.real, z.imag], -1)


def test_rope_bits(device):
    """Forward from the second half of a (B, T, 2 H hd) projection, read in place through its strides, and
    backward from a transposed dy: the float32 entries against the rotation by the angle, the bits entries
    their ml_dtypes rounding."""
    B, T, H, hd = 2, 5, 3, 8
    proj = _normal(B, T, 2 * H * hd)
    ang = _normal(T + 2, hd // 2, scale=2.0)
    cos, sin = (_dev(device, f(ang[:T]).astype(np.float32)) for f in (np.cos, np.sin))
    ang = ang[:T].astype(np.float64)
    x = _dev(device, proj)[:, :, H * hd:].reshape(B, T, H, hd)
    assert not x.flags.c_contiguous
    y = fused.rope_forward(device, x, cos, sin)
    want = _rotated(proj[:, :, H * hd:].reshape(B, T, H, hd), ang[:, None], 1).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(_host(y), want, **F32)
    _same_bits(fused.rope_forward(device, x, cos, sin, bits=True), y)
    dy = _normal(B, T, H, hd)
    dyd = _dev(device, dy).transpose(0, 2, 1, 3)                   # (B, H, T, hd), strided
    dx = fused.rope_backward(device, dyd, cos, sin)
    np.testing.assert_allclose(_host(dx), _rotated(dy, ang[:, None], -1), **F32)
    dxb = fused.rope_backward(device, dyd, cos, sin, bits=True)
    assert dxb.shape == (B, T, H, hd)
    _same_bits(dxb, dx)
    assert {"rope_fwd_f32_bf16", "rope_bwd_f32_bf16"} <= set(device.launches)


# ---------------------------------------------------------------- p read as bits

def test_softmax_backwards_read_bits(device):
    B, H, T, q0, n_q = 2, 3, 9, 4, 3
    ds = _normal(B, H, n_q, T)
    p = fused.causal_softmax_bits(device, _dev(device, _normal(B, H, n_q, T)), q0)
    pf = from_bf16_bits(np, _host(p))                               # the values the bits hold
    rs = _normal(B, H, T, 1)
    d32, db = _dev(device, ds), _dev(device, ds)
    fused.softmax_backward_(d32, _dev(device, pf), _dev(device, rs), q0)
    fused.softmax_backward_(db, p, _dev(device, rs), q0)
    np.testing.assert_allclose(_host(d32), (ds.astype(np.float64) - rs[:, :, q0:q0 + n_q]) * pf, **F32)
    _same(db, d32)
    rows = _dev(device, rs[:, :, :n_q])
    d32, db = _dev(device, ds), _dev(device, ds)
    fused.grouped_softmax_backward_(d32, _dev(device, pf), rows)
    fused.grouped_softmax_backward_(db, p, rows)
    np.testing.assert_allclose(_host(d32), (ds.astype(np.float64) - rs[:, :, :n_q]) * pf, **F32)
    _same(db, d32)
    assert {"softmax_bwd_f32_bf16", "grouped_softmax_bwd_f32_bf16"} <= set(device.launches)


# ---------------------------------------------------------------- rounding and refusals

def test_rounding_ties_overflow_inf_and_nan(device):
    """g = 2^14 saturates the gate (sigmoid(g) = 1), so a = 2^14 u exactly: a's bits are the rounding of known
    float32 values. Ties go to the even neighbour; past the largest bfloat16's half step is inf; a NaN keeps its
    sign and its high payload, quiet bit set."""
    cases = {                                     # float32 bits of a -> bfloat16 bits
        0x3F808000: 0x3F80, 0x3F818000: 0x3F82,   # 1 + 2^-8 and 1 + 3 2^-8: halfway, to the even neighbour
        0xBF808000: 0xBF80, 0xBF818000: 0xBF82,   # the same, negative
        0x3F808001: 0x3F81, 0x3F807FFF: 0x3F80,   # just past and just short of halfway
        0x7F7F7FFF: 0x7F7F, 0x7F7F8000: 0x7F80,   # the largest bfloat16 stays, its half step up rounds to inf
        0x7F7FFFFF: 0x7F80, 0xFF7FFFFF: 0xFF80,   # the largest float32s: to +-inf
        0x7F800000: 0x7F80, 0xFF800000: 0xFF80,   # inf
        0x7FC12345: 0x7FC1, 0xFFC00001: 0xFFC0,   # quiet NaNs: sign and high payload kept
    }
    a = np.array(list(cases), np.uint32).view(np.float32)
    u = a * np.float32(2.0 ** -14)
    g = np.full(u.shape, 2.0 ** 14, np.float32)
    out, s = fused.swiglu_forward(device, _dev(device, g), _dev(device, u), bits=True)
    assert (_host(s) == 1).all()
    assert [hex(v) for v in _host(out)] == [hex(v) for v in cases.values()]
    wide = _normal(4000) * np.float32(2.0) ** RNG.integers(-60, 60, 4000).astype(np.float32)
    out, _ = fused.swiglu_forward(device, _dev(device, g[:1].repeat(4000)), _dev(device, wide * 2 ** -14), bits=True)
    np.testing.assert_array_equal(_host(out), _bf16(wide))


def test_bits_want_float32(device):
    x64 = device.asarray(np.ones((2, 8)))
    w64 = device.asarray(np.ones(8))
    with pytest.raises(ValueError, match="float32 arrays only, not float64"):
        fused.rmsnorm_forward(device, x64, w64, 1e-5, bits=True)
    with pytest.raises(ValueError, match="float32"):
        fused.layernorm_forward(device, x64, w64, w64, 1e-5, bits=True)
    with pytest.raises(ValueError, match="float32"):
        fused.gelu_forward(device, x64, bits=True)
    with pytest.raises(ValueError, match="float32"):
        fused.swiglu_forward(device, x64, x64, bits=True)
    with pytest.raises(ValueError, match="float32"):
        fused.swiglu_backward(device, x64, x64, x64, x64, bits=True)
    x4, tab = device.asarray(np.ones((1, 2, 1, 4))), device.asarray(np.ones((2, 2)))
    with pytest.raises(ValueError, match="float32"):
        fused.rope_forward(device, x4, tab, tab, bits=True)
    with pytest.raises(ValueError, match="float32"):
        fused.rope_backward(device, x4, tab, tab, bits=True)
    with pytest.raises(ValueError, match="float32"):
        fused.causal_softmax_bits(device, device.asarray(np.ones((2, 4, 4))), 0)
    with pytest.raises(ValueError, match="contiguous"):
        fused.causal_softmax_bits(device, device.asarray(np.ones((2, 4, 8), np.float32))[..., :4], 0)
    p = device.zeros((1, 2, 4), dtype=np.uint16)
    with pytest.raises(ValueError, match="float32"):
        fused.softmax_backward_(device.asarray(np.ones((1, 2, 4))), p, device.asarray(np.ones((1, 4, 1))), 0)
    with pytest.raises(ValueError, match="float32"):
        fused.grouped_softmax_backward_(device.asarray(np.ones((1, 2, 4))), p, device.asarray(np.ones((1, 2, 1))))
    assert not [e for e in device.launches if e.endswith("_bf16")]
