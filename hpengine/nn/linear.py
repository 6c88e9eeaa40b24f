"""Dense (affine) layer: y = x @ w + b over any number of leading dims.
Leading dims are folded into one so every product is a single 2-D GEMM.
"""
from hpengine.device.bf16_bits import as_float32
from hpengine.nn import fused, gemm
from hpengine.nn.numerics import OFF


def linear_forward(xp, x, w, b=None, num=OFF):
    # x: (..., C), w: (C, OC), b: (OC,) or None -> y: (..., OC)
    # num (nn/numerics.py): the GEMM's operands, and whether y is stored as bfloat16 (bits when packed:
    # num.product_stored), for consumers that read it so (num.float32_out: y as the GEMM sums it)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if num.stores:
        return num.product_stored(xp, x2, w, b).reshape(*lead, w.shape[1]), (x2, lead)
    y = num.matmul(xp, x2, w) if num.bf16 else x2 @ w
    if b is not None:
        y += b
    # the cache keeps no weight: under stage-3 sharding the gathered weights are freed after forward
    return y.reshape(*lead, w.shape[1]), (x2, lead)


# linear_backward is its two
# halves, which a zero-bubble pipeline runs apart (Qi et al. 2023): linear_backward_input (B, dx, which
# the previous stage waits for) and linear_backward_weight (W, dw and db, which can wait).
def linear_backward(xp, dy, cache, w, dw, db=None, num=OFF):
    # dy: (..., OC), w, dw: (C, OC), db: (OC,) or None -> dx: (..., C)
    with num.converted(xp, dy.reshape(-1, dw.shape[1])):     # bf16 amp: dy converted once for both products
        linear_backward_weight(xp, dy, cache, dw, db, num)
        return linear_backward_input(xp, dy, cache, w, num)


def linear_backward_input(xp, dy, cache, w, num=OFF):
    # dy: (..., OC), w: (C, OC) -> dx: (..., C)
    """The input half (B) of linear_backward: dx = dy @ w.T, no weight gradient.

    Reads only the leading shape from `cache`, never the input, so a cache from linear_drop_input will
    do. This and linear_backward_weight, in either order, accumulate bit for bit what linear_backward
    does, on every path. dy is left as it was.
    """
    lead = cache[1]
    dy2 = dy.reshape(-1, w.shape[1])
    dx = num.matmul(xp, dy2, w.T) if num.bf16 else dy2 @ w.T
    return dx.reshape(*lead, w.shape[0])


def linear_backward_weight(xp, dy, cache, dw, db=None, num=OFF):
    # dy: (..., OC), dw: (C, OC), db: (OC,) or None -> None
    """The weight half (W) of linear_backward: dw += x.T @ dy, db += the column sums of dy.

    Run after linear_backward_input, it needs the same dy, unmodified: a fused caller sometimes writes
    into dy right after backward (`dx1 += ...` in models/gpt.py); one that defers W must stop doing so
    or hand W a copy. The cache's input must be there (linear_restore_input puts back one that was
    dropped). A deferred W of a bf16 amp pass takes the same num as its B.
    """
    x2 = cache[0]
    dy2 = dy.reshape(-1, dw.shape[1])
    if num.bf16:                                             # bf16 amp: bfloat16 operands, float32 sums
        num.matmul(xp, x2.T, dy2, dw, accumulate=True)
    elif fused.usable(xp, x2, dy2, dw):
        gemm.matmul(xp, x2.T, dy2, dw, accumulate=True)     # cuBLAS adds into dw: no temporary
    else:
        dw += x2.T @ dy2
    if db is None:
        return
    if not (fused.bits_usable(xp, dy2) and db.dtype == xp.float32):   # the kernel reads bf16 amp's bits itself
        dy2 = as_float32(xp, dy2)
    if fused.usable(xp, db) and db.flags.c_contiguous and dy2.dtype in (db.dtype, xp.uint16):
        fused.colsum_(xp, dy2, db)
    else:
        db += dy2.sum(axis=0)


def linear_drop_input(cache):
    """The cache without its input, for a caller that can rebuild x more cheaply than keep it."""
    return (None,) + tuple(cache[1:])


def linear_restore_input(cache, x):
    """A cache from linear_drop_input with its input x put back."""
    return (x.reshape(-1, x.shape[-1]),) + tuple(cache[1:])
