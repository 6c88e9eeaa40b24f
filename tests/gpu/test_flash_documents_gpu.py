"""Packed documents on the flash kernels (segment ids): attention.cu (float64, float32) and the tensor-core
attention_mma.cu (bf16 amp) against their twin, nn/flash.py's blocked code on the host with the same segments:
outputs, lse and gradients, GPT's fused qkv and grouped-query heads, documents on and off the tile edges, two
batch rows with different documents (the kernels skip per row, the twin per tile of all rows). NaN keys in one
document show its tiles are skipped, not masked, for the others. Skips cleanly without CuPy and a device.

Tolerances (relative to max(1, the largest reference value)) are those of test_flash_gpu.py and
test_flash_mma_gpu.py, for the same reasons: float64 1e-11 and float32 2e-5 differ from the twin only in the
order of sums over at most T = 200 keys of O(1) terms; the tensor-core kernels and the twin (num=BF16, key
blocks of the kernels' BN) round the same operands to bfloat16 at the same points, and a float32 sum-order
difference can flip one bfloat16 rounding of P or dS (2^-9 relative): o 1e-2, gradients 2e-2, lse 2e-5."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hpengine.device import backend, kernels
from hpengine.device.precision import round_bf16_
from hpengine.nn import Numerics, flash, flash_cuda

BF16 = Numerics(bf16=True)

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")
cp = backend.cupy_module() if backend.cupy_usable() else None
TOL = {np.float64: 1e-11, np.float32: 2e-5}
TOL_O, TOL_LSE, TOL_GRAD = 1e-2, 2e-5, 2e-2
KEYS = flash_cuda.MMA_TILES[64][0]
ROWS = [[70, 5, 90, 35], [1, 64, 64, 71]]           # T 200: edges on and off every tile size, a document of one


def ids(lengths_per_row):
    return np.array([np.repeat(np.arange(len(ls)), ls) for ls in lengths_per_row])


def close(dev, host, tol):
    got = (cp.asnumpy(dev) if isinstance(dev, cp.ndarray) else np.asarray(dev)).astype(np.float64)
    want = np.asarray(host, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    err = np.abs(got - want).max()
    assert err <= tol * max(1.0, float(np.abs(want).max())), (err, float(np.abs(want).max()))


def r16(a):
    return round_bf16_(np, np.array(a, dtype=np.float32))


@pytest.fixture
def entries(monkeypatch):
    """The entries flash_cuda launches: the comparisons must go through the kernels."""
    seen, real = [], kernels.function

    def spy(name, entry, path=None):
        seen.append(entry)
        return real(name, entry, path)
    monkeypatch.setattr(kernels, "function", spy)
    return seen


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("hd", [16, 64])
def test_gpt_layout_with_documents(entries, dtype, hd):
    B, T, H = 2, 200, 3
    rng = np.random.default_rng(1)
    seg = ids(ROWS)
    qkv = (rng.standard_normal((B, T, 3 * H * hd)) * 1.5).astype(dtype)
    dy = rng.standard_normal((B, T, H * hd)).astype(dtype)
    y, c = flash.flash_attention_forward(np, qkv.astype(np.float64), H, 7, 5, segments=seg)
    dq = flash.flash_attention_backward(np, dy.astype(np.float64), c, segments=seg)
    segd = cp.asarray(seg)
    yd, cd = flash.flash_attention_forward(cp, cp.asarray(qkv), H, segments=segd)
    dqd = flash.flash_attention_backward(cp, cp.asarray(dy), cd, segments=segd)
    sfx = flash_cuda.suffix(dtype)
    assert entries == [f"flash_{op}_{sfx}" for op in ("fwd", "bwd_dq", "bwd_dkdv")]
    close(yd, y, TOL[dtype])
    close(cd[2], c[2], TOL[dtype])
    close(dqd, dq, TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("H,K", [(4, 2), (4, 1)])
def test_gqa_layout_with_documents(entries, dtype, H, K):
    B, T, hd = 2, 200, 32
    rng = np.random.default_rng(2)
    seg = ids(ROWS)
    q = (rng.standard_normal((B, H, T, hd)) / math.sqrt(hd) * 2).astype(dtype)
    k, v = (rng.standard_normal((B, K, T, hd)).astype(dtype) for _ in range(2))
    dy = rng.standard_normal((B, T, H * hd)).astype(dtype)
    y, c = flash.flash_gqa_forward(np, *(a.astype(np.float64) for a in (q, k, v)), 6, 4, segments=seg)
    grads = flash.flash_gqa_backward(np, dy.astype(np.float64), c, segments=seg)
    segd = cp.asarray(seg)
    yd, cd = flash.flash_gqa_forward(cp, cp.asarray(q), cp.asarray(k), cp.asarray(v), segments=segd)
    gradsd = flash.flash_gqa_backward(cp, cp.asarray(dy), cd, segments=segd)
    assert len(entries) == 3 and all(e.startswith("flash_") and "mma" not in e for e in entries)
    close(yd, y, TOL[dtype])
    for got, want in zip(gradsd, grads):
        close(got, want, TOL[dtype])


@pytest.mark.parametrize("H,K,hd", [(2, 2, 64), (4, 2, 128), (4, 1, 48)])
def test_tensor_core_entries_with_documents(entries, H, K, hd):
    B, T = 2, 200
    rng = np.random.default_rng(3)
    seg = ids(ROWS)
    q = r16(rng.standard_normal((B, H, T, hd)) / math.sqrt(hd) * 2)
    k, v = r16(rng.standard_normal((B, K, T, hd))), r16(rng.standard_normal((B, K, T, hd)))
    dy = r16(rng.standard_normal((B, T, H * hd)))
    y, c = flash.flash_gqa_forward(np, q, k, v, 16, KEYS, num=BF16, segments=seg)
    grads = flash.flash_gqa_backward(np, dy, c, BF16, segments=seg)
    segd = cp.asarray(seg)
    yd, cd = flash.flash_gqa_forward(cp, cp.asarray(q), cp.asarray(k), cp.asarray(v), num=BF16, segments=segd)
    gradsd = flash.flash_gqa_backward(cp, cp.asarray(dy), cd, BF16, segments=segd)
    bound = 64 if hd <= 64 else 128
    assert entries == [f"flash_mma_{op}_f32_hd{bound}" for op in ("fwd", "bwd_dq", "bwd_dkdv")]
    close(yd, y, TOL_O)
    close(cd[4], c[4], TOL_LSE)
    for got, want in zip(gradsd, grads):
        close(got, want, TOL_GRAD)


def test_tiles_no_document_spans_are_skipped_on_the_device(entries):
    """NaN keys and values in document A (128 tokens, on every tile edge): a visited but masked tile would carry
    them into document B through 0 * NaN, so B's outputs and query gradients are finite and equal B run alone
    only if A's tiles are skipped; NaN queries and output gradients in B likewise leave A's key and value
    gradients alone. The SIMT entries (float32) and the tensor-core ones (bf16 amp)."""
    T, A, H, hd = 256, 128, 2, 64
    rng = np.random.default_rng(4)
    seg = cp.asarray(ids([[A, T - A]]))
    q, k, v = (r16(rng.standard_normal((1, H, T, hd)) / 4) for _ in range(3))
    dy = r16(rng.standard_normal((1, T, H * hd)))
    for num, tol_o, tol_g in ((Numerics(), TOL[np.float32], TOL[np.float32]), (BF16, TOL_O, TOL_GRAD)):
        def run(q, k, v, dy, segments):
            y, c = flash.flash_gqa_forward(cp, *(cp.asarray(a) for a in (q, k, v)), num=num, segments=segments)
            return (y, *flash.flash_gqa_backward(cp, cp.asarray(dy), c, num, segments=segments))
        poisoned = k.copy(), v.copy()
        for a in poisoned:
            a[:, :, :A] = np.nan
        y, dq, _, _ = run(q, *poisoned, dy, seg)
        yb, dqb, _, _ = run(q[:, :, A:], k[:, :, A:], v[:, :, A:], dy[:, A:], None)
        close(y[:, A:], cp.asnumpy(yb), tol_o)
        close(dq[:, :, A:], cp.asnumpy(dqb), tol_g)
        q_nan, dy_nan = q.copy(), dy.copy()
        q_nan[:, :, A:], dy_nan[:, A:] = np.nan, np.nan
        _, _, dk, dv = run(q_nan, k, v, dy_nan, seg)
        _, _, dka, dva = run(q[:, :, :A], k[:, :, :A], v[:, :, :A], dy[:, :A], None)
        close(dk[:, :, :A], cp.asnumpy(dka), tol_g)
        close(dv[:, :, :A], cp.asnumpy(dva), tol_g)
    assert {e.split("_")[1] for e in entries} == {"fwd", "bwd", "mma"}
