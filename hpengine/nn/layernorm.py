"""Layer normalisation over the last dim, with affine weight and bias.

The cache keeps the normalised input and 1/std so backward needs no recompute.
Row sums are GEMVs / einsums: a reduction over a short last axis is several
times slower in NumPy and would allocate a temporary for every product.
"""


def _rowsum(xp, a):
    # a: (N, C) -> (N, 1)
    return (a @ xp.ones(a.shape[-1], dtype=a.dtype))[:, None]


def layernorm_forward(xp, x, w, b, eps=1e-5):
    # x: (..., C), w: (C,), b: (C,) -> y: (..., C)
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    mean = _rowsum(xp, x2)
    mean *= 1.0 / C
    xhat = x2 - mean
    var = xp.einsum("ij,ij->i", xhat, xhat)[:, None]
    var *= 1.0 / C
    var += eps
    rstd = xp.sqrt(var, out=var)
    xp.reciprocal(rstd, out=rstd)
    xhat *= rstd
    y = xhat * w
    y += b
    return y.reshape(x.shape), (xhat, rstd, w)


def layernorm_backward(xp, dy, cache, dw, db):
    # dy: (..., C), dw: (C,), db: (C,) -> dx: (..., C)
    xhat, rstd, w = cache
    C = w.shape[0]
    dy2 = dy.reshape(-1, C)
    db += dy2.sum(axis=0)
    dw += xp.einsum("ij,ij->j", dy2, xhat)
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), with g = dy * w
    g = dy2 * w
    mg = _rowsum(xp, g)
    mgx = xp.einsum("ij,ij->i", g, xhat)[:, None]
    mg *= rstd * (1.0 / C)
    mgx *= rstd * (1.0 / C)
    g *= rstd
    g -= mg
    mgx = xhat * mgx
    g -= mgx
    return g.reshape(dy.shape)
