"""kernels/attention.cu (through hpengine/nn/flash_cuda.py and nn/flash.py) against its NumPy twin,
flash.py's blocked code run on the host: outputs, lse and gradients in float64 and float32, GPT's fused
qkv and grouped-query heads (groups 1, 2, 4 and multi-query), T not a multiple of the tiles; the bf16
entries against the twin run in float64 on the bf16-rounded inputs. Skips cleanly without CuPy and a
device."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hpengine.device import backend
from hpengine.nn import flash, flash_cuda

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")
cp = backend.cupy_module() if backend.cupy_usable() else None
TOL = {np.float64: 1e-11, np.float32: 2e-5}


def close(dev, host, tol):
    got, want = cp.asnumpy(dev).astype(np.float64), np.asarray(host, np.float64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= tol * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("T,hd", [(37, 16), (64, 64), (5, 128)])
def test_gpt_layout(dtype, T, hd):
    B, H = 2, 3
    rng = np.random.default_rng(1)
    qkv = (rng.standard_normal((B, T, 3 * H * hd)) * 1.5).astype(dtype)
    dy = rng.standard_normal((B, T, H * hd)).astype(dtype)
    y, c = flash.flash_attention_forward(np, qkv.astype(np.float64), H, 7, 5)
    dq = flash.flash_attention_backward(np, dy.astype(np.float64), c)
    yd, cd = flash.flash_attention_forward(cp, cp.asarray(qkv), H)
    assert yd.dtype == dtype and cd[2].dtype == dtype
    close(yd, y, TOL[dtype])
    close(cd[2], c[2], TOL[dtype])
    close(flash.flash_attention_backward(cp, cp.asarray(dy), cd), dq, TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("H,K,T", [(2, 2, 33), (4, 2, 40), (8, 2, 17), (4, 1, 50)])
def test_gqa_layout(dtype, H, K, T):
    B, hd = 2, 32
    rng = np.random.default_rng(2)
    q = (rng.standard_normal((B, H, T, hd)) / math.sqrt(hd) * 2).astype(dtype)
    k = rng.standard_normal((B, K, T, hd)).astype(dtype)
    vbase = rng.standard_normal((B, T, K * hd)).astype(dtype)
    v = vbase.reshape(B, T, K, hd).transpose(0, 2, 1, 3)
    dy = rng.standard_normal((B, T, H * hd)).astype(dtype)
    y, c = flash.flash_gqa_forward(np, *(a.astype(np.float64) for a in (q, k, v)), 6, 4)
    grads = flash.flash_gqa_backward(np, dy.astype(np.float64), c)
    vd = cp.asarray(vbase).reshape(B, T, K, hd).transpose(0, 2, 1, 3)       # strided, as in the model
    yd, cd = flash.flash_gqa_forward(cp, cp.asarray(q), cp.asarray(k), vd)
    close(yd, y, TOL[dtype])
    for got, want in zip(flash.flash_gqa_backward(cp, cp.asarray(dy), cd), grads):
        close(got, want, TOL[dtype])


@pytest.mark.parametrize("H,K,T,hd", [(4, 2, 45, 64), (2, 2, 16, 128)])
def test_bf16_entries_against_the_twin_on_rounded_inputs(H, K, T, hd):
    B = 2
    rng = np.random.default_rng(3)
    r16 = lambda a: flash_cuda.from_bf16(np, flash_cuda.to_bf16(np, a.astype(np.float32)))   # noqa: E731
    q = r16(rng.standard_normal((B, H, T, hd)) / math.sqrt(hd))
    k, v = r16(rng.standard_normal((B, K, T, hd))), r16(rng.standard_normal((B, K, T, hd)))
    dy = r16(rng.standard_normal((B, H, T, hd)))
    g = H // K
    qg = q.astype(np.float64).reshape(B, K, g, T, hd).swapaxes(2, 3).reshape(B, K, T * g, hd)
    og, lse = flash.flash_forward_core(np, qg, k.astype(np.float64), v.astype(np.float64), g, 8, 8)
    dog = dy.astype(np.float64).reshape(B, K, g, T, hd).swapaxes(2, 3).reshape(B, K, T * g, hd)
    dqg, dk, dv = flash.flash_backward_core(np, qg, k.astype(np.float64), v.astype(np.float64), og, dog, lse, g)
    per_head = lambda a: a.reshape(B, K, T, g, hd).swapaxes(2, 3).reshape(B, H, T, hd)      # noqa: E731
    bits = lambda a: flash_cuda.to_bf16(cp, cp.asarray(a))                                  # noqa: E731
    qd, kd, vd, dyd = (bits(a) for a in (q, k, v, dy))
    od = cp.empty(qd.shape, cp.uint16)
    lsed = flash_cuda.forward(cp, qd, kd, vd, od, 1.0)
    dqd, dkd, dvd = cp.empty(qd.shape, cp.uint16), cp.empty(kd.shape, cp.uint16), cp.empty(kd.shape, cp.uint16)
    flash_cuda.backward(cp, qd, kd, vd, od, dyd, lsed, dqd, dkd, dvd, 1.0)
    f32 = lambda a: flash_cuda.from_bf16(cp, a)                                             # noqa: E731
    close(lsed, lse.reshape(B, K, T, g).swapaxes(2, 3).reshape(B, H, T), 1e-5)     # grouped rows: (t, head)
    # bf16 stores round to 2^-9 relative; backward also starts from the rounded output
    close(f32(od), per_head(og), 1e-2)
    close(f32(dqd), per_head(dqg), 3e-2)
    close(f32(dkd), dk, 3e-2)
    close(f32(dvd), dv, 3e-2)
