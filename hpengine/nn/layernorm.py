"""Layer normalisation over the last dim, with affine weight and bias.
The cache keeps the normalised input and 1/std so backward needs no recompute.
"""
from hpengine.device.bf16_bits import as_float32
from hpengine.nn import fused
from hpengine.nn.numerics import OFF


# Row means are GEMVs / einsums: a reduction over a short last axis is several
# times slower in NumPy and would allocate a temporary for every product. Half
# precision (amp) keeps NumPy's reductions, which accumulate in float32.
def _rowmean(xp, a, b=None):
    # mean over the last axis of a (or of a * b): (N, C) -> (N, 1)
    C = a.shape[-1]
    if a.dtype.itemsize < 4:
        return (a if b is None else a * b).mean(axis=-1, keepdims=True)
    if b is None:  # 1/C inside the vector: no extra pass, and the sum never leaves the data's range
        return (a @ xp.full(C, 1.0 / C, dtype=a.dtype))[:, None]
    m = xp.einsum("ij,ij->i", a, b)[:, None]
    m *= 1.0 / C
    return m


def layernorm_forward(xp, x, w, b, eps=1e-5, num=OFF):
    # x: (..., C), w: (C,), b: (C,) -> y: (..., C)
    # num (nn/numerics.py): how y, which only GEMMs read, is stored (num.store_for_gemm; num.float32_out for a
    # float32 reader), and the cached xhat with it (y made from the float32 xhat)
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    if fused.usable(xp, x2, w, b):
        bits = num.writes_bits and x2.dtype == xp.float32
        y, xhat, rstd = fused.layernorm_forward(xp, x2, w, b, eps, bits=bits, cache_bits=bits)
        store = num.store_for_gemm
        return store(xp, y).reshape(x.shape), (store(xp, xhat), rstd)
    xhat = x2 - _rowmean(xp, x2)
    var = _rowmean(xp, xhat, xhat)
    var += eps
    rstd = xp.sqrt(var, out=var)
    xp.reciprocal(rstd, out=rstd)
    xhat *= rstd
    y = xhat * w
    y += b
    store = num.store_for_gemm
    return store(xp, y).reshape(x.shape), (store(xp, xhat), rstd)


def layernorm_backward(xp, dy, cache, w, dw, db):
    # dy: (..., C), w, dw, db: (C,) -> dx: (..., C)
    xhat, rstd = cache
    C = w.shape[0]
    dy2 = dy.reshape(-1, C)
    kernel = fused.usable(xp, dy2, rstd, w) and xhat.dtype in (dy2.dtype, xp.uint16)   # xhat bits: bf16 amp
    if kernel and fused.usable(xp, dy2, dw, db) and dw.flags.c_contiguous and db.flags.c_contiguous:
        fused.colsum_(xp, dy2, db)
        fused.colsum_(xp, dy2, dw, xhat)
    else:
        xhat = as_float32(xp, xhat)
        db += dy2.sum(axis=0)
        dw += (dy2 * xhat).sum(axis=0) if dy2.dtype.itemsize < 4 else xp.einsum("ij,ij->j", dy2, xhat)
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), with g = dy * w
    if kernel:
        return fused.layernorm_backward_dx(xp, dy2, xhat, rstd, w).reshape(dy.shape)
    xhat = as_float32(xp, xhat)
    g = dy2 * w
    mg = _rowmean(xp, g)
    mgx = _rowmean(xp, g, xhat)
    mg *= rstd
    mgx *= rstd
    g *= rstd
    g -= mg
    mgx = xhat * mgx
    g -= mgx
    return g.reshape(dy.shape)


def layernorm_backward_input(xp, dy, cache, w, dw, db):
    # dy: (..., C), w, dw, db: (C,) -> dx: (..., C)
    """The input half (B) of a split backward, which also takes the weight gradients: it is
    layernorm_backward itself, and layernorm_backward_weight is a no-op.

    dw and db are two column sums over (N, C), fewer passes than dx makes anyway and tiny beside the
    GEMMs around a norm, so deferring them would save the critical path almost nothing; deferred, they
    would keep dy and the cached xhat, two (N, C) arrays, alive until W, and bind the caller to leave dy
    unmodified. Done here, the cache and dy are free as soon as B returns.
    """
    return layernorm_backward(xp, dy, cache, w, dw, db)


def layernorm_backward_weight(xp, dy, cache, dw, db):
    # dy: (..., C), dw, db: (C,) -> None; adds nothing (layernorm_backward_input did)
    """The weight half (W) of the split: a no-op (layernorm_backward_input says why), with the arguments
    of linear_backward_weight so a queue of W halves can call each the same way; it reads none of them."""


def layernorm_cache_elements(n: int, C: int) -> int:
    """Elements the forward caches for n rows of width C: xhat and one rstd per row."""
    return n * C + n
