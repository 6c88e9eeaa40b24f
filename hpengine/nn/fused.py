"""The CuPy path of the layers' element-wise and row-wise work: one launch of kernels/fused.cu each, in
place of a chain of CuPy calls that each launch a kernel and make a pass over memory. The NumPy code
beside each call site in hpengine/nn is the twin: same formulas, used on the CPU and for float16.

Under bfloat16 amp the outputs that only feed bf16 GEMMs can come out as bfloat16 bits (uint16, rounded as
device/bf16_bits.py's TO_BF16_BODY) from the same launch: `bits=True` on gelu_forward, layernorm_forward,
rmsnorm_forward, swiglu_forward and swiglu_backward, and causal_softmax_bits; the softmax backwards read p as
bits when it is uint16. These take float32 arrays only.

`ENABLED` switches the fused path off (benchmarks/gpu_profile.py compares both).
"""
from __future__ import annotations

import numpy as np

from hpengine.device import kernels

ENABLED = True
_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
BITS = np.dtype(np.uint16)


def usable(xp, *arrays) -> bool:
    """True when the fused kernels take these arrays: CuPy, one dtype, float32 or float64."""
    return (ENABLED and xp.__name__ == "cupy" and arrays[0].dtype in _SUFFIX
            and all(a.dtype == arrays[0].dtype for a in arrays))


def _fn(entry: str, dtype, bits: bool = False):
    return kernels.function("fused", f"{entry}_{_SUFFIX[np.dtype(dtype)]}" + ("_bf16" if bits else ""))


def _float32(what: str, *arrays) -> None:
    # the _bf16 entries exist for float32 math only
    bad = [a.dtype for a in arrays if a.dtype != np.float32]
    if bad:
        raise ValueError(f"{what}: bfloat16 bits come from float32 arrays only, not {bad[0]}")


def _out(xp, like, bits: bool):
    return xp.empty(like.shape, dtype=BITS) if bits else xp.empty_like(like)


def _row_threads(n_cols: int) -> int:
    # about four elements per thread, 32 .. 1024 threads
    return int(min(1024, max(32, 1 << max(0, (n_cols - 1).bit_length() - 2))))


def _rows(entry, dtype, n_rows, n_cols, args, bits=False):
    _fn(entry, dtype, bits)((max(1, min(int(n_rows), 1 << 20)),), (_row_threads(n_cols),), args)


def _points(entry, dtype, n, args, bits=False):
    _fn(entry, dtype, bits)((kernels.blocks_for(n),), (kernels.THREADS,), args)


def gelu_forward(xp, x, bits=False):
    """-> y = gelu(x) and the cache s, contiguous, of x's shape; y as bfloat16 bits with bits=True."""
    x = xp.ascontiguousarray(x)
    if bits:
        _float32("gelu_forward", x)
    y, s = _out(xp, x, bits), xp.empty_like(x)
    _points("gelu_fwd", x.dtype, x.size, (x, y, s, np.int64(x.size)), bits)
    return y, s


def gelu_backward(xp, x, s, dy):
    x, s, dy = xp.ascontiguousarray(x), xp.ascontiguousarray(s), xp.ascontiguousarray(dy)
    dx = xp.empty_like(dy)
    _points("gelu_bwd", dy.dtype, dy.size, (x, s, dy, dx, np.int64(dy.size)))
    return dx


def causal_softmax_(p, q0: int):
    """In place on scores p (..., n_q, n_cols) of queries q0 .. q0 + n_q - 1."""
    n_q, n_cols = p.shape[-2:]
    n_rows = p.size // n_cols
    _rows("causal_softmax", p.dtype, n_rows, n_cols, (p, np.int64(n_rows), np.int32(n_cols), np.int32(n_q),
                                                      np.int32(q0)))


def causal_softmax_bits(xp, z, q0: int):
    """The bfloat16 bits (uint16, z's shape) of the causal softmax of float32 scores z (..., n_q, n_cols),
    contiguous, of queries q0 .. q0 + n_q - 1: causal_softmax_'s float32 values, rounded; z is left as it is."""
    _float32("causal_softmax_bits", z)
    if not z.flags.c_contiguous:
        raise ValueError("causal_softmax_bits: z must be contiguous")
    n_q, n_cols = z.shape[-2:]
    n_rows = z.size // n_cols
    p = xp.empty(z.shape, dtype=BITS)
    _rows("causal_softmax", z.dtype, n_rows, n_cols, (z, p, np.int64(n_rows), np.int32(n_cols), np.int32(n_q),
                                                      np.int32(q0)), True)
    return p


def softmax_backward_(ds, p, rs, q0: int):
    """In place: ds = (ds - rs) * p, with rs (..., T, 1) holding one value per query of the whole sequence; p
    may be bfloat16 bits (uint16), ds and rs then float32."""
    bits = p.dtype == BITS
    if bits:
        _float32("softmax_backward_", ds, rs)
    n_q, n_cols = ds.shape[-2:]
    _points("softmax_bwd", ds.dtype, ds.size, (ds, p, rs, np.int64(ds.size), np.int32(n_cols), np.int32(n_q),
                                               np.int32(q0), np.int32(rs.shape[-2])), bits)


def grouped_softmax_backward_(ds, p, rs):
    """In place: ds = (ds - rs) * p, with ds, p (..., n_cols) contiguous and rs (..., 1) one value per row; p may
    be bfloat16 bits (uint16), ds and rs then float32."""
    if not (ds.flags.c_contiguous and p.flags.c_contiguous):
        raise ValueError("grouped_softmax_backward_: ds and p must be contiguous")
    bits = p.dtype == BITS
    if bits:
        _float32("grouped_softmax_backward_", ds, rs)
    rs = rs if rs.flags.c_contiguous else rs.copy()
    _points("grouped_softmax_bwd", ds.dtype, ds.size, (ds, p, rs, np.int64(ds.size), np.int32(ds.shape[-1])), bits)


def layernorm_forward(xp, x2, w, b, eps, bits=False):
    """x2 (N, C) -> y, xhat (N, C), rstd (N, 1); y as bfloat16 bits with bits=True."""
    x2, w, b = xp.ascontiguousarray(x2), xp.ascontiguousarray(w), xp.ascontiguousarray(b)
    if bits:
        _float32("layernorm_forward", x2, w, b)
    n, c = x2.shape
    y, xhat, rstd = _out(xp, x2, bits), xp.empty_like(x2), xp.empty((n, 1), dtype=x2.dtype)
    _rows("layernorm_fwd", x2.dtype, n, c, (x2, w, b, y, xhat, rstd, np.int64(n), np.int32(c), x2.dtype.type(eps)),
          bits)
    return y, xhat, rstd


def layernorm_backward_dx(xp, dy2, xhat, rstd, w):
    dy2, xhat, rstd, w = (xp.ascontiguousarray(a) for a in (dy2, xhat, rstd, w))
    n, c = dy2.shape
    dx = xp.empty_like(dy2)
    _rows("layernorm_bwd", dy2.dtype, n, c, (dy2, xhat, rstd, w, dx, np.int64(n), np.int32(c)))
    return dx


def rmsnorm_forward(xp, x2, w, eps, bits=False):
    """x2 (N, C) -> y, xhat (N, C), rstd (N, 1); y as bfloat16 bits with bits=True."""
    x2, w = xp.ascontiguousarray(x2), xp.ascontiguousarray(w)
    if bits:
        _float32("rmsnorm_forward", x2, w)
    n, c = x2.shape
    y, xhat, rstd = _out(xp, x2, bits), xp.empty_like(x2), xp.empty((n, 1), dtype=x2.dtype)
    _rows("rmsnorm_fwd", x2.dtype, n, c, (x2, w, y, xhat, rstd, np.int64(n), np.int32(c), x2.dtype.type(eps)), bits)
    return y, xhat, rstd


def rmsnorm_backward_dx(xp, dy2, xhat, rstd, w):
    dy2, xhat, rstd, w = (xp.ascontiguousarray(a) for a in (dy2, xhat, rstd, w))
    n, c = dy2.shape
    dx = xp.empty_like(dy2)
    _rows("rmsnorm_bwd", dy2.dtype, n, c, (dy2, xhat, rstd, w, dx, np.int64(n), np.int32(c)))
    return dx


def _rope(entry, xp, x, cos, sin, out, n_t, n_h):
    # one thread per rotated pair of out; x is read in its own strides, passed in elements
    if any(st % x.itemsize for st in x.strides):
        x = xp.ascontiguousarray(x)
    cos, sin = xp.ascontiguousarray(cos), xp.ascontiguousarray(sin)
    if cos.shape != sin.shape or cos.shape[0] < n_t or 2 * cos.shape[1] != out.shape[-1]:
        raise ValueError(f"{entry}: tables {cos.shape}, {sin.shape} do not fit {n_t} positions of {out.shape}")
    n = out.size // 2
    strides = tuple(np.int64(st // x.itemsize) for st in x.strides)
    _points(entry, x.dtype, n, (x, cos, sin, out, np.int64(n), np.int32(n_t), np.int32(n_h),
                                np.int32(out.shape[-1] // 2)) + strides)
    return out


def rope_forward(xp, x, cos, sin):
    """x (B, T, H, hd) in any strides, cos and sin (T, hd/2) -> a new contiguous (B, H, T, hd)."""
    B, T, H, hd = x.shape
    return _rope("rope_fwd", xp, x, cos, sin, xp.empty((B, H, T, hd), dtype=x.dtype), T, H)


def rope_backward(xp, dy, cos, sin):
    """dy (B, H, T, hd) in any strides -> a new contiguous (B, T, H, hd), rotated back."""
    B, H, T, hd = dy.shape
    return _rope("rope_bwd", xp, dy, cos, sin, xp.empty((B, T, H, hd), dtype=dy.dtype), T, H)


def swiglu_forward(xp, g, u, bits=False):
    """-> a = g sigmoid(g) u and s = sigmoid(g), contiguous, of g's shape; a as bfloat16 bits with bits=True."""
    g, u = xp.ascontiguousarray(g), xp.ascontiguousarray(u)
    if bits:
        _float32("swiglu_forward", g, u)
    a, s = _out(xp, g, bits), xp.empty_like(g)
    _points("swiglu_fwd", g.dtype, g.size, (g, u, a, s, np.int64(g.size)), bits)
    return a, s


def swiglu_backward(xp, g, u, s, da, bits=False):
    """-> (dg, du), contiguous, of g's shape; as bfloat16 bits with bits=True."""
    g, u, s, da = (xp.ascontiguousarray(a) for a in (g, u, s, da))
    if bits:
        _float32("swiglu_backward", g, u, s, da)
    dg, du = _out(xp, g, bits), _out(xp, g, bits)
    _points("swiglu_bwd", g.dtype, g.size, (g, u, s, da, dg, du, np.int64(g.size)), bits)
    return dg, du


def colsum_(xp, a2, out, b2=None):
    """out += the column sums of a2 (N, C), or of a2 * b2, in a fixed order (no atomics); out contiguous."""
    if not out.flags.c_contiguous:
        raise ValueError("colsum_: out must be contiguous")
    a2 = xp.ascontiguousarray(a2)
    n, c = a2.shape
    chunks = int(max(1, min(256, -(-n // 64))))
    part = xp.empty((chunks, c), dtype=a2.dtype)
    grid, block = (-(-c // 32), chunks), (32, 8)
    if b2 is None:
        _fn("colsum_part", a2.dtype)(grid, block, (a2, part, np.int64(n), np.int32(c)))
    else:
        _fn("colsum_prod_part", a2.dtype)(grid, block, (a2, xp.ascontiguousarray(b2), part, np.int64(n), np.int32(c)))
    _points("colsum_finish", a2.dtype, c, (part, out, np.int32(chunks), np.int32(c), np.int32(1)))


def _targets(xp, targets):
    return xp.ascontiguousarray(targets.reshape(-1), dtype=xp.int64)


def cross_entropy_forward(xp, logits, targets):
    """logits (..., V) -> softmax p (same shape) and the per-token loss nll (rows,)."""
    logits = xp.ascontiguousarray(logits)
    v = logits.shape[-1]
    n = logits.size // v
    p, nll = xp.empty_like(logits), xp.empty(n, dtype=logits.dtype)
    _rows("xent_fwd", logits.dtype, n, v, (logits, _targets(xp, targets), p, nll, np.int64(n), np.int32(v)))
    return p, nll


def cross_entropy_backward(xp, p, targets, scale: float):
    """(p - onehot(targets)) * scale."""
    d = xp.empty_like(p)
    _points("xent_bwd", p.dtype, p.size, (p, _targets(xp, targets), d, np.int64(p.size), np.int32(p.shape[-1]),
                                          p.dtype.type(scale)))
    return d
