"""The fused kernels' entries that keep the norms' caches and the softmax gradient as bfloat16 bits, on the CuPy
stand-in, launched through hpengine/nn/fused.py: <op>_f32_bf16x (a norm's y and xhat as bits), the norm backwards
and the weight gradient's column sums reading xhat as bits (<op>_f32_bf16i), and the softmax gradients written as
bits into a separate array (<op>_f32_bf16o). Each float32 entry first against its closed form, then: the bits
outputs equal ml_dtypes' bfloat16 of that entry's float32 outputs (nearest, ties to even: an oracle independent of
the stand-in's rounding), rstd equal to the float32 entry's, and what reads xhat's bits equal to the float32 entry
on the values they hold. Dtype mixes that fit no entry are refused before any launch."""
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
EPS = 1e-5
RNG = np.random.default_rng(31)


@pytest.fixture(autouse=True)
def rng(monkeypatch):
    monkeypatch.setitem(globals(), "RNG", np.random.default_rng(31))


@pytest.fixture
def device(monkeypatch):
    return emulated_cupy.install(monkeypatch)


def _normal(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _same(a, b):
    assert _host(a).dtype == _host(b).dtype and _host(a).tobytes() == _host(b).tobytes()


def _layernorm(device, x, w, b, **kw):
    return fused.layernorm_forward(device, *(_dev(device, a) for a in (x, w, b)), EPS, **kw)


def _rmsnorm(device, x, w, **kw):
    return fused.rmsnorm_forward(device, _dev(device, x), _dev(device, w), EPS, **kw)


def _inputs():
    return _normal(70, 45, scale=2.0) + np.float32(0.3), _normal(45), _normal(45)


# ---------------------------------------------------------------- y and xhat as bits

@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norm_forwards_write_y_and_xhat_as_bits(device, norm):
    """y and xhat: ml_dtypes' rounding of the float32 entry's, which are the closed forms' to float32 noise; y is
    rounded once from the float32 xhat, not computed from xhat's rounded value."""
    x, w, b = _inputs()
    x64 = x.astype(np.float64)
    if norm == "layernorm":
        want_h = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + EPS)
        y, xhat, rstd = _layernorm(device, x, w, b)
        yb, xhb, rsb = _layernorm(device, x, w, b, bits=True, cache_bits=True)
        shift = b
    else:
        want_h = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS)
        y, xhat, rstd = _rmsnorm(device, x, w)
        yb, xhb, rsb = _rmsnorm(device, x, w, bits=True, cache_bits=True)
        shift = np.float32(0)
    np.testing.assert_allclose(_host(xhat), want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_host(y), want_h * w + shift, rtol=1e-5, atol=1e-5)
    _same_bits(yb, _host(y))
    _same_bits(xhb, _host(xhat))
    _same(rsb, rstd)
    assert (_host(yb) != _bf16(_values(_host(xhb)) * w + shift)).any()     # not from the rounded xhat
    assert f"{norm}_fwd_f32_bf16x" in device.launches


# ---------------------------------------------------------------- xhat read as bits

@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norm_backwards_read_xhat_bits(device, norm):
    """dx from xhat's bits: the float32 entry's on the values they hold, bit for bit; that entry against the
    closed form of the backward on those values (the gradient itself is checked by finite differences in the
    norms' own tests)."""
    x, w, b = _inputs()
    dy = _normal(*x.shape)
    if norm == "layernorm":
        _, xhb, rstd = _layernorm(device, x, w, b, bits=True, cache_bits=True)
        backward = fused.layernorm_backward_dx
    else:
        _, xhb, rstd = _rmsnorm(device, x, w, bits=True, cache_bits=True)
        backward = fused.rmsnorm_backward_dx
    h = _values(_host(xhb))
    dx32 = backward(device, _dev(device, dy), _dev(device, h), rstd, _dev(device, w))
    h64, g = h.astype(np.float64), dy.astype(np.float64) * w
    want = g - h64 * (g * h64).mean(-1, keepdims=True)
    if norm == "layernorm":
        want -= g.mean(-1, keepdims=True)
    np.testing.assert_allclose(_host(dx32), want * _host(rstd), rtol=1e-5, atol=1e-5)
    dx = backward(device, _dev(device, dy), xhb, rstd, _dev(device, w))
    _same(dx, dx32)
    assert f"{norm}_bwd_f32_bf16i" in device.launches


def test_weight_gradient_reads_xhat_bits(device):
    """sum(dy * xhat) over rows of 3 chunks and 2 column blocks, added to out: the float32 entry's on the values of
    xhat's bits, bit for bit; that entry against NumPy's float64 sum."""
    dy = _normal(150, 45)
    _, xhb, _ = _rmsnorm(device, _normal(150, 45), _normal(45), bits=True, cache_bits=True)
    h = _values(_host(xhb))
    start = _normal(45)
    out32, out = _dev(device, start), _dev(device, start)
    fused.colsum_(device, _dev(device, dy), out32, _dev(device, h))
    np.testing.assert_allclose(_host(out32), start + (dy.astype(np.float64) * h).sum(0), rtol=1e-5, atol=1e-5)
    fused.colsum_(device, _dev(device, dy), out, xhb)
    _same(out, out32)
    assert "colsum_prod_part_f32_bf16i" in device.launches


# ---------------------------------------------------------------- the softmax gradient as bits

def test_softmax_gradients_write_bits(device):
    """(dP - rs) * p, computed in float32 on the values of p's bits, rounded by ml_dtypes; dP left as it is."""
    B, H, T, q0, n_q = 2, 3, 9, 4, 3
    ds = _normal(B, H, n_q, T)
    p = fused.causal_softmax_bits(device, _dev(device, _normal(B, H, n_q, T)), q0)
    pf = _values(_host(p))
    rs = _normal(B, H, T, 1)
    dsd = _dev(device, ds)
    out = fused.softmax_backward_bits(dsd, p, _dev(device, rs), q0)
    assert out.shape == ds.shape and out.flags.c_contiguous
    _same_bits(out, (ds - rs[:, :, q0:q0 + n_q]) * pf)
    rows = rs[:, :, :n_q].copy()
    grouped = fused.grouped_softmax_backward_bits(dsd, p, _dev(device, rows))
    _same_bits(grouped, (ds - rows) * pf)
    assert _host(dsd).tobytes() == ds.tobytes()
    ref = _dev(device, ds)
    fused.softmax_backward_(ref, p, _dev(device, rs), q0)              # the in-place entry's values, rounded
    _same_bits(out, _host(ref))
    assert {"softmax_bwd_f32_bf16o", "grouped_softmax_bwd_f32_bf16o"} <= set(device.launches)


# ---------------------------------------------------------------- refusals

def test_mixes_that_fit_no_entry_are_refused(device):
    b, f32, f64 = (device.asarray(np.ones((2, 8), t)) for t in (np.uint16, np.float32, np.float64))
    w32, w64, r32 = device.ones(8, np.float32), device.ones(8), device.ones((2, 1), np.float32)
    with pytest.raises(ValueError, match="rmsnorm_forward: cache_bits=True needs bits=True"):
        fused.rmsnorm_forward(device, f32, w32, EPS, cache_bits=True)
    with pytest.raises(ValueError, match="layernorm_forward: cache_bits=True needs bits=True"):
        fused.layernorm_forward(device, f32, w32, w32, EPS, cache_bits=True)
    with pytest.raises(ValueError, match="float32 arrays only, not float64"):
        fused.rmsnorm_forward(device, f64, w64, EPS, bits=True, cache_bits=True)
    with pytest.raises(ValueError, match="rmsnorm_backward_dx: no kernel entry takes xhat uint16, dy float64"):
        fused.rmsnorm_backward_dx(device, f64, b, r32, w32)
    with pytest.raises(ValueError, match="xhat float32, dy uint16"):
        fused.layernorm_backward_dx(device, b, f32, r32, w32)
    with pytest.raises(ValueError, match="colsum_: no kernel entry takes b2 uint16, a2 float64"):
        fused.colsum_(device, f64, device.zeros(8), b)
    with pytest.raises(ValueError, match="colsum_: no kernel entry reads a2 as bfloat16 bits"):
        fused.colsum_(device, b, device.zeros(8, np.float32), f32)
    p, rs = device.zeros((1, 2, 4), np.uint16), device.ones((1, 4, 1), np.float32)
    ds32, ds64 = device.ones((1, 2, 4), np.float32), device.ones((1, 2, 4))
    with pytest.raises(ValueError, match="softmax_backward_bits: no kernel entry takes p float32"):
        fused.softmax_backward_bits(ds32, ds32, rs, 0)
    with pytest.raises(ValueError, match="ds float64"):
        fused.softmax_backward_bits(ds64, p, rs, 0)
    with pytest.raises(ValueError, match="grouped_softmax_backward_bits: ds and p must be contiguous"):
        fused.grouped_softmax_backward_bits(device.ones((1, 2, 8), np.float32)[..., :4], p, rs[:, :2])
    assert not device.launches
