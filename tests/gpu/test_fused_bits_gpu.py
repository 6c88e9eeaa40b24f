"""The fused kernels' entries that keep the norms' caches and the softmax gradient as bfloat16 bits (_f32_bf16x,
the norm backwards' and the weight and bias gradients' _f32_bf16i, the softmax gradients' _f32_bf16o) against their
NumPy twins and against the float32 entries rounded by TO_BF16_BODY. Skips cleanly without CuPy and a device."""
from __future__ import annotations

import numpy as np
import pytest
from test_fused import close, close_bits, pair

from hpengine.device import backend
from hpengine.device.bf16_bits import bf16_bits_numpy, from_bf16_bits
from hpengine.nn import fused, layernorm_backward, layernorm_forward
from hpengine.nn.rmsnorm import rmsnorm_backward, rmsnorm_forward

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")
cp = backend.cupy_module() if backend.cupy_usable() else None
EPS = 1e-5


@pytest.mark.parametrize("rows,C", [(15, 7), (37, 96), (130, 1500)])
def test_norm_caches_as_bits(entries, rows, C):
    """y and xhat as bits: within a rounding of the twin's, and TO_BF16_BODY's rounding of the float32 entry's;
    rstd the float32 entry's. The backwards read xhat's bits: dx and the weight gradients against the twin on the
    values they hold, and against the float32 entries on those values."""
    rng = np.random.default_rng(18)
    x, xd = pair(rng, (rows, C), np.float32, 2.0)
    x += np.float32(1.5)                                            # a mean for layer norm to take away
    xd += np.float32(1.5)
    w, wd = pair(rng, (C,), np.float32)
    b, bd = pair(rng, (C,), np.float32)
    dy, dyd = pair(rng, (rows, C), np.float32)
    for norm in ("layernorm", "rmsnorm"):
        if norm == "layernorm":
            y, c = layernorm_forward(np, x, w, b)
            f32 = fused.layernorm_forward(cp, xd, wd, bd, EPS)
            yb, xhb, rstd = fused.layernorm_forward(cp, xd, wd, bd, EPS, bits=True, cache_bits=True)
            backward_dx = fused.layernorm_backward_dx
        else:
            y, c = rmsnorm_forward(np, x, w)
            f32 = fused.rmsnorm_forward(cp, xd, wd, EPS)
            yb, xhb, rstd = fused.rmsnorm_forward(cp, xd, wd, EPS, bits=True, cache_bits=True)
            backward_dx = fused.rmsnorm_backward_dx
        close_bits(yb, y, f32[0])
        close_bits(xhb, c[0], f32[1])
        close(rstd, c[1], np.float32)
        close(rstd, cp.asnumpy(f32[2]), np.float32)
        h = cp.asnumpy(from_bf16_bits(cp, xhb))
        dw, db = np.zeros(C, np.float32), np.zeros(C, np.float32)
        if norm == "layernorm":
            want = layernorm_backward(np, dy, (h, cp.asnumpy(rstd)), w, dw, db)
        else:
            want = rmsnorm_backward(np, dy, (h, cp.asnumpy(rstd)), w, dw)
        dx = backward_dx(cp, dyd, xhb, rstd, wd)
        assert dx.dtype == np.float32
        close(dx, want, np.float32)
        close(dx, cp.asnumpy(backward_dx(cp, dyd, cp.asarray(h), rstd, wd)), np.float32)
        dwd, dw32 = cp.zeros(C, dtype=np.float32), cp.zeros(C, dtype=np.float32)
        fused.colsum_(cp, dyd, dwd, xhb)
        fused.colsum_(cp, dyd, dw32, cp.asarray(h))
        close(dwd, dw, np.float32)
        close(dwd, cp.asnumpy(dw32), np.float32)
    assert {"layernorm_fwd_bf16x", "rmsnorm_fwd_bf16x", "layernorm_bwd_bf16i", "rmsnorm_bwd_bf16i",
            "colsum_prod_part_bf16i"} <= entries


@pytest.mark.parametrize("n_q,T,q0", [(5, 5, 0), (7, 40, 33), (64, 200, 100)])
def test_softmax_gradients_as_bits(entries, n_q, T, q0):
    """(dP - rs) * p from p's bits, written as bits: the rounding of NumPy's float32 (dP - rs) * p on p's values
    (no contraction: a product of a difference), and of the in-place entries' float32 result; dP left as it is."""
    rng = np.random.default_rng(19)
    z, zd = pair(rng, (2, 3, n_q, T), np.float32, 3.0)
    pb = fused.causal_softmax_bits(cp, zd, q0)
    pf = cp.asnumpy(from_bf16_bits(cp, pb))
    ds, dsd = pair(rng, z.shape, np.float32)
    rs, rsd = pair(rng, (2, 3, q0 + n_q, 1), np.float32)
    rows = rs[:, :, q0:q0 + n_q].copy()
    want = bf16_bits_numpy((ds - rows) * pf)
    out = fused.softmax_backward_bits(dsd, pb, rsd, q0)
    assert out.dtype == np.uint16 and (cp.asnumpy(out) == want).all()
    grouped = fused.grouped_softmax_backward_bits(dsd, pb, cp.asarray(rows))
    assert grouped.dtype == np.uint16 and (cp.asnumpy(grouped) == want).all()
    assert cp.asnumpy(dsd).tobytes() == ds.tobytes()
    d = dsd.copy()
    fused.softmax_backward_(d, pb, rsd, q0)
    close_bits(out, (ds - rows) * pf, d)
    assert {"softmax_bwd_bf16o", "grouped_softmax_bwd_bf16o"} <= entries


@pytest.mark.parametrize("rows,C", [(15, 7), (130, 2304)])
def test_bias_gradient_of_bits(entries, rows, C):
    """The column sums of a bits output gradient added to out: the float32 entry's on the values the bits hold, bit
    for bit (one order of sums), and NumPy's sum of those values within float32 sums' order."""
    rng = np.random.default_rng(20)
    bits = cp.asarray(bf16_bits_numpy(rng.standard_normal((rows, C)).astype(np.float32) * 3))
    vals = from_bf16_bits(cp, bits)
    start, out = pair(rng, (C,), np.float32)
    out32 = out.copy()
    fused.colsum_(cp, bits, out)
    fused.colsum_(cp, vals, out32)
    assert cp.asnumpy(out).tobytes() == cp.asnumpy(out32).tobytes()
    close(out, start + cp.asnumpy(vals).astype(np.float64).sum(0), np.float32)
    assert {"colsum_part_bf16i", "colsum_part"} <= entries
