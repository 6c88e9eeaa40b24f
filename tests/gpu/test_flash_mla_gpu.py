"""Flash attention with values narrower than the queries and keys (multi-head latent attention) on the kernels
(nn/flash_cuda.py pads v to the q/k width) against the NumPy twin run on the host: outputs, lse and gradients in
float64 and float32, with packed documents, and the tensor-core entries under bf16 amp (the tolerances of
test_flash_gpu.py and test_flash_mma_gpu.py). Skips cleanly without CuPy and a device."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hpengine.device import backend
from hpengine.nn import Numerics, flash, flash_cuda
from test_flash_gpu import TOL, close

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")
cp = backend.cupy_module() if backend.cupy_usable() else None


def inputs(seed, B, H, K, T, hd, dv, dtype):
    r = np.random.default_rng(seed)
    q = (r.standard_normal((B, H, T, hd)) * 2 / math.sqrt(hd)).astype(dtype)
    k = r.standard_normal((B, K, T, hd)).astype(dtype)
    vbase = r.standard_normal((B, T, K * dv)).astype(dtype)
    dy = r.standard_normal((B, T, H * dv)).astype(dtype)
    return q, k, vbase, dy


def segments(B, T):
    r = np.random.default_rng(9)
    return np.sort(r.integers(0, 4, (B, T)), axis=1).astype(np.int32)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("H,K,T,hd,dv,documents", [(4, 4, 37, 24, 16, False), (4, 2, 70, 64, 32, True),
                                                    (2, 2, 20, 128, 96, False)])
def test_narrow_values_against_the_twin(dtype, H, K, T, hd, dv, documents):
    B = 2
    q, k, vbase, dy = inputs(1, B, H, K, T, hd, dv, dtype)
    v = vbase.reshape(B, T, K, dv).transpose(0, 2, 1, 3)
    seg = segments(B, T) if documents else None
    y, c = flash.flash_gqa_forward(np, *(a.astype(np.float64) for a in (q, k, v)), segments=seg)
    grads = flash.flash_gqa_backward(np, dy.astype(np.float64), c, segments=seg)
    vd = cp.asarray(vbase).reshape(B, T, K, dv).transpose(0, 2, 1, 3)       # strided, as in the model
    segd = None if seg is None else cp.asarray(seg)
    yd, cd = flash.flash_gqa_forward(cp, cp.asarray(q), cp.asarray(k), vd, segments=segd)
    assert yd.shape == (B, T, H * dv) and yd.dtype == dtype
    close(yd, y, TOL[dtype])
    close(cd[4], c[4], TOL[dtype])
    for got, want in zip(flash.flash_gqa_backward(cp, cp.asarray(dy), cd, segments=segd), grads):
        close(got, want, TOL[dtype])


@pytest.mark.parametrize("hd,dv", [(48, 32), (96, 64)])
def test_narrow_values_on_tensor_cores_against_the_twin(hd, dv):
    """bf16 amp: the tensor-core entries and the twin with bfloat16 products on bf16-rounded inputs (o 1e-2,
    lse 2e-5, gradients 2e-2 of the largest value, as test_flash_mma_gpu.py reasons)."""
    B, H, K, T = 2, 4, 2, 45
    r16 = lambda a: flash_cuda.from_bf16(np, flash_cuda.to_bf16(np, a.astype(np.float32)))   # noqa: E731
    q, k, vbase, dy = (r16(a) for a in inputs(2, B, H, K, T, hd, dv, np.float32))
    v = vbase.reshape(B, T, K, dv).transpose(0, 2, 1, 3)
    num = Numerics(bf16=True)
    y, c = flash.flash_gqa_forward(np, q, k, v, num=num)
    grads = flash.flash_gqa_backward(np, dy.copy(), c, num)
    yd, cd = flash.flash_gqa_forward(cp, cp.asarray(q), cp.asarray(k), cp.asarray(v), num=num)
    close(yd, y, 1e-2)
    close(cd[4], c[4], 2e-5)
    for got, want in zip(flash.flash_gqa_backward(cp, cp.asarray(dy), cd, num), grads):
        close(got, want, 2e-2)
