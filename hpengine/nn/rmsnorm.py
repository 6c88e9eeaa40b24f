"""RMS normalisation over the last dim with a learned weight (no bias, no mean subtraction):
y = w * x / sqrt(mean(x^2) + eps), as Llama defines it.
"""
from hpengine.device.bf16_bits import as_float32
from hpengine.nn import fused
from hpengine.nn.numerics import OFF


def _compute_dtype(xp, dtype):
    return xp.float32 if dtype.itemsize < 4 else dtype


# The statistics are computed in float32 even when x is float16 (amp), like Hugging Face's
# LlamaRMSNorm: the normalised x is rounded back to x's dtype before the weight multiplies it. The
# cache keeps the normalised input (x's dtype) and 1/rms per row (float32 under amp), so backward
# needs no recompute.
def rmsnorm_forward(xp, x, w, eps=1e-5, num=OFF):
    # x: (..., C), w: (C,) -> y: (..., C)
    # num (nn/numerics.py): how y, which only GEMMs read, is stored (num.store_for_gemm; num.float32_out for a
    # float32 reader), and the cached xhat with it (y made from the float32 xhat)
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    if fused.usable(xp, x2, w):
        bits = num.writes_bits and x2.dtype == xp.float32
        y, xhat, rstd = fused.rmsnorm_forward(xp, x2, w, eps, bits=bits, cache_bits=bits)
        store = num.store_for_gemm
        return store(xp, y).reshape(x.shape), (store(xp, xhat), rstd)
    xc = x2.astype(_compute_dtype(xp, x.dtype), copy=False)
    # mean(x^2) as a dot product per row with 1/C folded in: one pass, no (N, C) temporary
    ms = xp.einsum("ij,ij->i", xc, xc)[:, None]
    ms *= 1.0 / C
    ms += eps
    rstd = xp.sqrt(ms, out=ms)
    xp.reciprocal(rstd, out=rstd)
    xhat = xc * rstd
    if xhat.dtype != x.dtype:
        xhat = xhat.astype(x.dtype)
    y = xhat * w
    store = num.store_for_gemm
    return store(xp, y).reshape(x.shape), (store(xp, xhat), rstd)


def rmsnorm_backward(xp, dy, cache, w, dw):
    # dy: (..., C), w, dw: (C,) -> dx: (..., C)
    # dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w; dw += sum over rows of dy * xhat
    xhat, rstd = cache
    C = w.shape[0]
    dy2 = dy.reshape(-1, C)
    kernel = fused.usable(xp, dy2, rstd, w) and xhat.dtype in (dy2.dtype, xp.uint16)   # xhat bits: bf16 amp
    if kernel and dw.flags.c_contiguous and dw.dtype == dy2.dtype:
        fused.colsum_(xp, dy2, dw, xhat)
    else:
        xhat = as_float32(xp, xhat)
        dw += (dy2 * xhat).sum(axis=0) if dy2.dtype.itemsize < 4 else xp.einsum("ij,ij->j", dy2, xhat)
    if kernel:
        return fused.rmsnorm_backward_dx(xp, dy2, xhat, rstd, w).reshape(dy.shape)
    xhat = as_float32(xp, xhat)
    ct = _compute_dtype(xp, dy.dtype)
    g = dy2.astype(ct) * w.astype(ct, copy=False)
    xh = xhat.astype(ct, copy=False)
    m = xp.einsum("ij,ij->i", g, xh)[:, None]
    m *= 1.0 / C
    g -= xh * m
    g *= rstd
    return g.astype(dy.dtype, copy=False).reshape(dy.shape)


def rmsnorm_backward_input(xp, dy, cache, w, dw):
    # dy: (..., C), w, dw: (C,) -> dx: (..., C)
    """The input half (B) of a split backward, which also takes the weight gradient: it is
    rmsnorm_backward itself, and rmsnorm_backward_weight is a no-op.

    dw is one column sum over (N, C), tiny beside the GEMMs around a norm, so deferring it would save the
    critical path almost nothing; deferred, it would keep dy and the cached xhat, two (N, C) arrays, alive
    until W, and bind the caller to leave dy unmodified. Done here, the cache and dy are free as soon as B
    returns.
    """
    return rmsnorm_backward(xp, dy, cache, w, dw)


def rmsnorm_backward_weight(xp, dy, cache, dw):
    # dy: (..., C), dw: (C,) -> None; adds nothing (rmsnorm_backward_input did)
    """The weight half (W) of the split: a no-op (rmsnorm_backward_input says why), with the arguments
    of linear_backward_weight less db; it reads none of them."""


def rmsnorm_cache_bytes(n: int, C: int, item: int) -> int:
    """Bytes the forward caches for n rows of width C in a dtype of `item` bytes: the normalised input
    and one 1/rms per row (float32 when the data is half precision)."""
    return n * C * item + n * max(item, 4)
