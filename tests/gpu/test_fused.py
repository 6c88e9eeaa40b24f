"""The fused layer kernels (kernels/fused.cu through hpengine/nn/fused.py) against their NumPy twins, the
layers' NumPy code: forward outputs, caches and backward results, in float64 and float32, over row lengths
that are not multiples of a warp and causal blocks of any size. Skips cleanly without CuPy and a device.
"""
from __future__ import annotations

import numpy as np
import pytest

from hpengine import backend
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
