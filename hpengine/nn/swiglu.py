"""SiLU gating, the middle of Llama's SwiGLU MLP: a = silu(g) * u with silu(g) = g * sigmoid(g).

The cache keeps g, u and s = sigmoid(g); the output a (the down projection's input) is rebuilt from
them in backward (two multiplies), a quarter less MLP activation memory than keeping it.
d/dg silu(g) = s (1 + g (1 - s)).
"""
from hpengine.nn import fused
from hpengine.nn.activation import _no_overflow_warning


def swiglu_forward(xp, g, u):
    # g, u: (...) -> a: (...)
    if fused.usable(xp, g, u):
        a, s = fused.swiglu_forward(xp, g, u)
        return a, (g, u, s)
    s = xp.negative(g)
    with _no_overflow_warning(xp):      # exp overflows to inf for very negative g: the sigmoid is then 0
        xp.exp(s, out=s)
    s += 1.0
    xp.divide(1.0, s, out=s)            # np.reciprocal's quotient, twice as fast in NumPy 2
    a = g * s
    a *= u
    return a, (g, u, s)


def swiglu_recompute(xp, cache):
    # -> exactly the array swiglu_forward returned (same ops, same order)
    g, u, s = cache
    a = g * s
    a *= u
    return a


def swiglu_backward(xp, da, cache):
    # da: (...) -> (dg, du)
    g, u, s = cache
    if fused.usable(xp, g, u, s, da):
        return fused.swiglu_backward(xp, g, u, s, da)
    du = g * s
    du *= da
    dg = 1.0 - s
    dg *= g
    dg += 1.0
    dg *= s
    dg *= u
    dg *= da
    return dg, du


def swiglu_cache_elements(n: int) -> int:
    """Elements the forward caches for n outputs: g, u and sigmoid(g)."""
    return 3 * n
