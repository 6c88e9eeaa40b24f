"""kernels/attention_mma.cu (flash attention on tensor cores, chosen by nn/flash_cuda.py under bf16 amp)
against its twin, nn/flash.py's blocked code run on the host with a bf16 policy (num=BF16), on
bf16-rounded inputs: outputs, lse and gradients for GPT's fused qkv and grouped-query heads (groups 1, 2, 4
and multi-query), head dims at and below the 64 and 128 bounds, T not a multiple of the 64-row tiles; the
bfloat16-bits entries likewise. Skips cleanly without CuPy and a device.

Tolerances (relative to max(1, the largest reference value)). Kernel and twin round the same operands to
bfloat16 at the same points (q * scale, k, v, dO, and the float32 P and dS before their products); the twin
walks key blocks of the forward kernels' BN = 64, since the running max at which P is rounded depends on
where the key tiles start. They differ in the order of float32 sums, which moves a score by a few float32
ulps and can flip a P or dS element across a bfloat16 rounding midpoint: one bfloat16 step, at most 2^-9 for
p <= 1, so a flip moves o by at most 2^-9 |v| / l, about 8e-3 for the largest |v| of these draws (flips are
rare and typical errors far smaller): o 1e-2, gradients (sums of more such products, through dS) 2e-2. lse
sums the unrounded P in float32 on both sides: 2e-5, as for the float32 kernels. Against exact float64
attention on the same inputs the kernels carry bfloat16's rounding of q * scale, P and dS (2^-9 each,
averaging over keys): 3e-2, far below what a wrong index gives (order 1). bfloat16-bits outputs are rounded
to 2^-9 on store: 1e-2, and 3e-2 for the gradients, which start from the rounded output."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hpengine.device import backend, kernels
from hpengine.device.precision import round_bf16_
from hpengine.nn import Numerics, flash, flash_cuda

BF16 = Numerics(bf16=True)     # the layers' policy under bf16 amp (float32 storage)

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")
cp = backend.cupy_module() if backend.cupy_usable() else None
TOL_O, TOL_LSE, TOL_GRAD, TOL_EXACT = 1e-2, 2e-5, 2e-2, 3e-2
KEYS = flash_cuda.MMA_TILES[64][0]      # the forward kernels' key tile (BN), the same for both head-dim bounds


def close(dev, host, tol):
    got = (cp.asnumpy(dev) if isinstance(dev, cp.ndarray) else np.asarray(dev)).astype(np.float64)
    want = np.asarray(host, np.float64)
    assert got.shape == want.shape
    err = np.abs(got - want).max()
    assert err <= tol * max(1.0, float(np.abs(want).max())), (err, float(np.abs(want).max()))


def r16(a):
    return round_bf16_(np, np.array(a, dtype=np.float32))


@pytest.fixture
def entries(monkeypatch):
    """The entries flash_cuda launches."""
    seen, real = [], kernels.function

    def spy(name, entry, path=None):
        seen.append(entry)
        return real(name, entry, path)
    monkeypatch.setattr(kernels, "function", spy)
    return seen


def _bound(hd):
    return 64 if hd <= 64 else 128


@pytest.mark.parametrize("T,hd", [(37, 64), (80, 32), (70, 128), (5, 96)])
def test_gpt_layout_under_bf16_amp(entries, T, hd):
    B, H = 2, 3
    rng = np.random.default_rng(1)
    qkv = r16(rng.standard_normal((B, T, 3 * H * hd)) * 1.5)
    dy = r16(rng.standard_normal((B, T, H * hd)))
    y, c = flash.flash_attention_forward(np, qkv, H, 16, KEYS, num=BF16)
    dqkv = flash.flash_attention_backward(np, dy, c, BF16)
    yd, cd = flash.flash_attention_forward(cp, cp.asarray(qkv), H, num=BF16)
    dqkvd = flash.flash_attention_backward(cp, cp.asarray(dy), cd, BF16)
    assert entries == [f"flash_mma_{op}_f32_hd{_bound(hd)}" for op in ("fwd", "bwd_dq", "bwd_dkdv")]
    close(yd, y, TOL_O)
    close(cd[2], c[2], TOL_LSE)
    close(dqkvd, dqkv, TOL_GRAD)
    y64, c64 = flash.flash_attention_forward(np, qkv.astype(np.float64), H)
    close(yd, y64, TOL_EXACT)
    close(dqkvd, flash.flash_attention_backward(np, dy.astype(np.float64), c64), TOL_EXACT)


@pytest.mark.parametrize("H,K,T,hd", [(2, 2, 33, 64), (4, 2, 40, 128), (8, 2, 17, 48), (4, 1, 100, 64)])
def test_gqa_layout_under_bf16_amp(entries, H, K, T, hd):
    B = 2
    rng = np.random.default_rng(2)
    q = r16(rng.standard_normal((B, H, T, hd)) / math.sqrt(hd) * 2)
    k = r16(rng.standard_normal((B, K, T, hd)))
    vbase = r16(rng.standard_normal((B, T, K * hd)))
    v = vbase.reshape(B, T, K, hd).transpose(0, 2, 1, 3)
    dy = r16(rng.standard_normal((B, T, H * hd)))
    vd = cp.asarray(vbase).reshape(B, T, K, hd).transpose(0, 2, 1, 3)       # strided, as in the model
    y, c = flash.flash_gqa_forward(np, q, k, v, 16, KEYS, num=BF16)
    grads = flash.flash_gqa_backward(np, dy, c, BF16)
    yd, cd = flash.flash_gqa_forward(cp, cp.asarray(q), cp.asarray(k), vd, num=BF16)
    gradsd = flash.flash_gqa_backward(cp, cp.asarray(dy), cd, BF16)
    assert entries == [f"flash_mma_{op}_f32_hd{_bound(hd)}" for op in ("fwd", "bwd_dq", "bwd_dkdv")]
    close(yd, y, TOL_O)
    close(cd[4], c[4], TOL_LSE)
    for got, want in zip(gradsd, grads):
        close(got, want, TOL_GRAD)
    y64, c64 = flash.flash_gqa_forward(np, *(a.astype(np.float64) for a in (q, k, v)))
    close(yd, y64, TOL_EXACT)
    for got, want in zip(gradsd, flash.flash_gqa_backward(np, dy.astype(np.float64), c64)):
        close(got, want, TOL_EXACT)


@pytest.mark.parametrize("H,K,T,hd", [(4, 2, 45, 64), (2, 2, 16, 128), (4, 4, 130, 80)])
def test_bf16_bits_entries_read_two_byte_inputs(entries, H, K, T, hd):
    B = 2
    rng = np.random.default_rng(3)
    q = r16(rng.standard_normal((B, H, T, hd)) / math.sqrt(hd))
    k, v = r16(rng.standard_normal((B, K, T, hd))), r16(rng.standard_normal((B, K, T, hd)))
    dy = r16(rng.standard_normal((B, T, H * hd)))
    y, c = flash.flash_gqa_forward(np, q, k, v, 16, KEYS, num=BF16)
    dq, dk, dv = flash.flash_gqa_backward(np, dy, c, BF16)
    per_head = lambda a: a.reshape(B, T, H, hd).transpose(0, 2, 1, 3)        # noqa: E731
    bits = lambda a: flash_cuda.to_bf16(cp, cp.asarray(a))                    # noqa: E731
    qd, kd, vd, dyd = bits(q), bits(k), bits(v), bits(np.ascontiguousarray(per_head(dy)))
    od = cp.empty(qd.shape, cp.uint16)
    lsed = flash_cuda.forward(cp, qd, kd, vd, od, 1.0, mma=True)
    dqd, dkd, dvd = cp.empty(qd.shape, cp.uint16), cp.empty(kd.shape, cp.uint16), cp.empty(kd.shape, cp.uint16)
    flash_cuda.backward(cp, qd, kd, vd, od, dyd, lsed, dqd, dkd, dvd, 1.0, mma=True)
    assert entries == [f"flash_mma_{op}_bf16_hd{_bound(hd)}" for op in ("fwd", "bwd_dq", "bwd_dkdv")]
    f32 = lambda a: flash_cuda.from_bf16(cp, a)                               # noqa: E731
    close(lsed, c[4], TOL_LSE)
    close(f32(od), per_head(y), 1e-2)
    close(f32(dqd), dq, 3e-2)
    close(f32(dkd), dk, 3e-2)
    close(f32(dvd), dv, 3e-2)
