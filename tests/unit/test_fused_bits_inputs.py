"""The fused kernels' entries that read a GEMM's output as bfloat16 bits (<op>_f32_bf16i of kernels/fused.cu) on
the CuPy stand-in, launched through hpengine/nn/fused.py. Inputs are bfloat16 values (ml_dtypes' rounding of
normal draws) held as bits; the float32 entry on their float32 values is checked against its closed form (rotation
by the angle, SiLU gating, GELU's tanh form), and then: the bits outputs equal ml_dtypes' bfloat16 of that entry's
outputs, a float32 output equals it exactly, and where the cache s is bits too, the forward's output equals
ml_dtypes' bfloat16 of NumPy's float32 product on the values of the inputs and of s's bits (what the recompute
entries rebuild, equal to the forward's bits); a bias gradient's column sums of bits equal the float32 entry's on
their values. Dtype mixes that fit no entry are refused before any launch."""
from __future__ import annotations

import emulated_cupy
import numpy as np
import pytest
from bits_helpers import bf16 as _bf16
from bits_helpers import dev as _dev
from bits_helpers import host as _host
from bits_helpers import same_bits as _same_bits
from bits_helpers import values as _values

from hpengine.nn import fused

F32 = {"rtol": 2e-6, "atol": 2e-6}
RNG = np.random.default_rng(21)


@pytest.fixture(autouse=True)
def rng(monkeypatch):
    monkeypatch.setitem(globals(), "RNG", np.random.default_rng(21))


@pytest.fixture
def device(monkeypatch):
    return emulated_cupy.install(monkeypatch)


def _bits_input(*shape, scale=1.0):
    """(bits, their float32 values) of bfloat16-rounded normal draws."""
    bits = _bf16(RNG.standard_normal(shape) * scale)
    return bits, _values(bits)


def _rotated(x, ang, sign):
    """x (..., hd) with each pair (x[k], x[k + hd/2]) turned by sign * ang (..., hd/2), in float64."""
    h = x.shape[-1] // 2
    z = (x[..., :h].astype(np.float64) + 1j * x[..., h:]) * np.exp(sign * 1j * ang)
    return np.concatenate([z.real, z.imag], -1)


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_rope_reads_a_strided_bits_view(device, fused_qkv):
    """q's (B, T, H, hd) view of a bits projection output (B, T, H hd), or of the first third of a fused
    (B, T, 3 H hd) one, strided: read in place through its element strides (the stand-in holds the launch to
    them); y's bits are the rounding of the float32 entry's rotation of the values, read through the same view."""
    B, T, H, hd = 2, 6, 3, 8
    width = (3 if fused_qkv else 1) * H * hd
    proj, vals = _bits_input(B, T, width, scale=2.0)
    ang = RNG.standard_normal((T + 3, hd // 2)) * 2
    cos, sin = (_dev(device, f(ang[:T]).astype(np.float32)) for f in (np.cos, np.sin))
    x = _dev(device, proj)[:, :, :H * hd].reshape(B, T, H, hd)
    x32 = _dev(device, vals)[:, :, :H * hd].reshape(B, T, H, hd)
    assert x.dtype == np.uint16 and x.strides == tuple(st // 2 for st in x32.strides)
    assert x.flags.c_contiguous != fused_qkv
    y32 = fused.rope_forward(device, x32, cos, sin)
    want = _rotated(vals[:, :, :H * hd].reshape(B, T, H, hd), ang[:T, None], 1).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(_host(y32), want, **F32)
    for bits in (False, True):                  # bits in: bits out, whatever `bits` says
        y = fused.rope_forward(device, x, cos, sin, bits=bits)
        assert y.shape == (B, H, T, hd) and y.flags.c_contiguous
        _same_bits(y, _host(y32))
    assert "rope_fwd_f32_bf16i" in device.launches


def test_gelu_reads_bits(device):
    xb, x = _bits_input(3, 43, scale=3.0)
    y32, s32 = fused.gelu_forward(device, _dev(device, x))
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(_host(y32), 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3))),
                               **F32)
    y, s = fused.gelu_forward(device, _dev(device, xb))
    _same_bits(s, _host(s32))
    sv = _values(_host(s))
    _same_bits(y, x * sv)                                           # y from the value s holds
    # two bfloat16 roundings (s, y) of at most 2^-8 each away from the float32 entry's y
    assert (np.abs(_values(_host(y)) - _host(y32)) <= 2.0 ** -7 * np.abs(_host(y32))).all()
    np.testing.assert_array_equal(_host(fused.gelu_recompute(device, _dev(device, xb), s)), _host(y))
    dy = RNG.standard_normal(x.shape).astype(np.float32)
    dx32 = fused.gelu_backward(device, _dev(device, x), _dev(device, sv), _dev(device, dy))
    k = np.sqrt(2 / np.pi)
    s64 = sv.astype(np.float64)
    want = dy * (s64 + 2 * x64 * s64 * (1 - s64) * k * (1 + 3 * 0.044715 * x64 ** 2))
    np.testing.assert_allclose(_host(dx32), want, rtol=1e-5, atol=1e-5)
    dx = fused.gelu_backward(device, _dev(device, xb), s, _dev(device, dy))
    _same_bits(dx, _host(dx32))                                     # bits: only GEMMs and a bias gradient read it
    assert {"gelu_fwd_f32_bf16i", "gelu_bwd_f32_bf16i", "gelu_recompute_f32_bf16i"} <= set(device.launches)


def test_gating_reads_bits(device):
    (gb, g), (ub, u) = _bits_input(4, 37, scale=3.0), _bits_input(4, 37)
    a32, s32 = fused.swiglu_forward(device, _dev(device, g), _dev(device, u))
    g64 = g.astype(np.float64)
    np.testing.assert_allclose(_host(a32), g64 / (1 + np.exp(-g64)) * u, **F32)
    for bits in (False, True):
        a, s = fused.swiglu_forward(device, _dev(device, gb), _dev(device, ub), bits=bits)
        _same_bits(s, _host(s32))
        sv = _values(_host(s))
        prod = g * sv
        prod *= u                                                   # (g s) u, as nn/swiglu.swiglu_recompute
        _same_bits(a, prod)
        again = fused.swiglu_recompute(device, _dev(device, gb), _dev(device, ub), s)
        np.testing.assert_array_equal(_host(again), _host(a))
    da = RNG.standard_normal(g.shape).astype(np.float32)
    dg32, du32 = fused.swiglu_backward(device, *(_dev(device, v) for v in (g, u, sv, da)))
    s64 = sv.astype(np.float64)
    np.testing.assert_allclose(_host(du32), g64 * s64 * da, **F32)
    np.testing.assert_allclose(_host(dg32), (s64 + g64 * s64 * (1 - s64)) * u * da, **F32)
    dg, du = fused.swiglu_backward(device, _dev(device, gb), _dev(device, ub), s, _dev(device, da))
    _same_bits(dg, _host(dg32))
    _same_bits(du, _host(du32))
    assert {"swiglu_fwd_f32_bf16i", "swiglu_bwd_f32_bf16i", "swiglu_recompute_f32_bf16i"} <= set(device.launches)


def test_bias_gradient_reads_bits(device):
    """The column sums of a bits output gradient over 3 chunks of rows and 2 column blocks, added to out: the
    float32 entry's on the bits' values, bit for bit; that entry against NumPy's float64 sum of those values."""
    db, dv = _bits_input(150, 45, scale=3.0)
    start = RNG.standard_normal(45).astype(np.float32)
    out32, out = _dev(device, start), _dev(device, start)
    fused.colsum_(device, _dev(device, dv), out32)
    np.testing.assert_allclose(_host(out32), start + dv.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    fused.colsum_(device, _dev(device, db), out)
    assert _host(out).dtype == np.float32 and _host(out).tobytes() == _host(out32).tobytes()
    assert {"colsum_part_f32_bf16i", "colsum_part_f32"} <= set(device.launches)


def test_mixes_that_fit_no_entry_are_refused(device):
    b, f32, f64 = (device.asarray(np.ones((2, 8), t)) for t in (np.uint16, np.float32, np.float64))
    with pytest.raises(ValueError, match="swiglu_forward: no kernel entry takes g uint16, u float32"):
        fused.swiglu_forward(device, b, f32)
    with pytest.raises(ValueError, match="g float32, u float32, s uint16, da float32"):
        fused.swiglu_backward(device, f32, f32, b, f32)
    with pytest.raises(ValueError, match="da float64"):
        fused.swiglu_backward(device, b, b, b, f64)
    with pytest.raises(ValueError, match="gelu_forward"):
        fused.gelu_forward(device, f64, bits=True)
    with pytest.raises(ValueError, match="x uint16, s float32, dy float32"):
        fused.gelu_backward(device, b, f32, f32)
    with pytest.raises(ValueError, match="dy uint16"):
        fused.gelu_backward(device, f32, f32, b)
    with pytest.raises(ValueError, match="gelu_recompute: bfloat16 bits .* not x float32, s float32"):
        fused.gelu_recompute(device, f32, f32)
    with pytest.raises(ValueError, match="u float32"):
        fused.swiglu_recompute(device, b, f32, b)
    x4, tab, tab64 = device.zeros((1, 2, 1, 4), np.uint16), device.ones((2, 2), np.float32), device.ones((2, 2))
    with pytest.raises(ValueError, match="x uint16, cos float64, sin float64"):
        fused.rope_forward(device, x4, tab64, tab64)
    with pytest.raises(ValueError, match="cos uint16"):
        fused.rope_forward(device, device.ones((1, 2, 1, 4), np.float32), b[:2, :2].copy(), tab)
    with pytest.raises(ValueError, match="rope_backward: no kernel entry reads dy as bfloat16 bits"):
        fused.rope_backward(device, x4, tab, tab)
    with pytest.raises(ValueError, match="colsum_: no kernel entry takes a2 uint16, out float64"):
        fused.colsum_(device, b, device.zeros(8))
    assert not device.launches
