"""Dense (affine) layer: y = x @ w + b over any number of leading dims.

Leading dims are folded into one so every product is a single 2-D GEMM.
"""
from hpengine.nn import bf16_gemm, fused, gemm


def linear_forward(xp, x, w, b=None):
    # x: (..., C), w: (C, OC), b: (OC,) or None -> y: (..., OC)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = bf16_gemm.matmul(xp, x2, w) if bf16_gemm.active() else x2 @ w
    if b is not None:
        y += b
    # the cache keeps no weight: under stage-3 sharding the gathered weights are freed after forward
    return y.reshape(*lead, w.shape[1]), (x2, lead)


def linear_backward(xp, dy, cache, w, dw, db=None):
    # dy: (..., OC), w, dw: (C, OC), db: (OC,) or None -> dx: (..., C)
    x2, lead = cache
    dy2 = dy.reshape(-1, w.shape[1])
    if bf16_gemm.active():                                   # bf16 amp: bfloat16 operands, float32 sums
        bf16_gemm.matmul(xp, x2.T, dy2, dw, accumulate=True)
    elif fused.usable(xp, x2, dy2, dw):
        gemm.matmul(xp, x2.T, dy2, dw, accumulate=True)     # cuBLAS adds into dw: no temporary
    else:
        dw += x2.T @ dy2
    if db is not None and fused.usable(xp, dy2, db) and db.flags.c_contiguous:
        fused.colsum_(xp, dy2, db)
    elif db is not None:
        db += dy2.sum(axis=0)
    dx = bf16_gemm.matmul(xp, dy2, w.T) if bf16_gemm.active() else dy2 @ w.T
    return dx.reshape(*lead, w.shape[0])


def linear_drop_input(cache):
    """The cache without its input, for a caller that can rebuild x more cheaply than keep it."""
    return (None,) + tuple(cache[1:])


def linear_restore_input(cache, x):
    """A cache from linear_drop_input with its input x put back."""
    return (x.reshape(-1, x.shape[-1]),) + tuple(cache[1:])
