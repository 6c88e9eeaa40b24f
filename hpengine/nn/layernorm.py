"""Layer normalisation over the last dim, with affine weight and bias.

The cache keeps the normalised input and 1/std so backward needs no recompute.
"""


def layernorm_forward(xp, x, w, b, eps=1e-5):
    # x: (..., C), w: (C,), b: (C,) -> y: (..., C)
    mean = x.mean(axis=-1, keepdims=True)
    xhat = x - mean
    var = (xhat * xhat).mean(axis=-1, keepdims=True)
    var += eps
    rstd = xp.sqrt(var, out=var)
    xp.reciprocal(rstd, out=rstd)
    xhat *= rstd
    y = xhat * w
    y += b
    return y, (xhat, rstd, w)


def layernorm_backward(xp, dy, cache, dw, db):
    # dy: (..., C), dw: (C,), db: (C,) -> dx: (..., C)
    xhat, rstd, w = cache
    C = w.shape[0]
    dy2 = dy.reshape(-1, C)
    db += dy2.sum(axis=0)
    dw += (dy2 * xhat.reshape(-1, C)).sum(axis=0)
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), with g = dy * w
    g = dy * w
    mg = g.mean(axis=-1, keepdims=True)
    mgx = (g * xhat).mean(axis=-1, keepdims=True)
    g -= mg
    mgx = xhat * mgx
    g -= mgx
    g *= rstd
    return g
