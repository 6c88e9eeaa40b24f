"""SiLU gating, the middle of Llama's SwiGLU MLP: a = silu(g) * u with silu(g) = g * sigmoid(g).
"""
from hpengine.device.bf16_bits import as_float32
from hpengine.nn import fused
from hpengine.nn.activation import _no_overflow_warning
from hpengine.nn.numerics import OFF


# The cache keeps g, u and s = sigmoid(g); the output a (the down projection's input) is rebuilt from
# them in backward (two multiplies), a quarter less MLP activation memory than keeping it.
def swiglu_forward(xp, g, u, num=OFF):
    # g, u: (...) -> a: (...)
    # num.stores (nn/numerics.py): g and u are GEMM outputs stored in bfloat16 (num.product_stored) and only
    # GEMMs read a, dg, du: s, a, dg and du are stored as the GEMMs take them (bits when packed), a made from
    # the s stored, so swiglu_recompute rebuilds it bit for bit
    if num.stores:
        if fused.bits_usable(xp, g, u):
            a, s = fused.swiglu_forward(xp, g, u)           # bits in, bits out
            return a, (g, u, s)
        g32, u32 = as_float32(xp, g), as_float32(xp, u)
        s = num.store_for_gemm(xp, _sigmoid(xp, g32))
        return swiglu_recompute(xp, (g32, u32, s), num), (g, u, s)
    if fused.usable(xp, g, u):
        a, s = fused.swiglu_forward(xp, g, u)
        return a, (g, u, s)
    s = _sigmoid(xp, g)
    a = g * s
    a *= u
    return a, (g, u, s)


def _sigmoid(xp, g):
    s = xp.negative(g)
    with _no_overflow_warning(xp):      # exp overflows to inf for very negative g: the sigmoid is then 0
        xp.exp(s, out=s)
    s += 1.0
    xp.divide(1.0, s, out=s)            # np.reciprocal's quotient, twice as fast in NumPy 2
    return s


def swiglu_recompute(xp, cache, num=OFF):
    # -> exactly the array swiglu_forward returned (same ops, same order)
    g, u, s = cache
    if num.stores:
        if fused.bits_usable(xp, g, u, s):
            return fused.swiglu_recompute(xp, g, u, s)
        g, u, s = (as_float32(xp, t) for t in (g, u, s))
    a = g * s
    a *= u
    return num.store_for_gemm(xp, a)


# d/dg silu(g) = s (1 + g (1 - s)).
def swiglu_backward(xp, da, cache, num=OFF):
    # da: (...) -> (dg, du)
    g, u, s = cache
    if num.stores:
        if fused.bits_usable(xp, g, u, s) and da.dtype == xp.float32:
            return fused.swiglu_backward(xp, g, u, s, da)   # dg, du as bits
        g, u, s = (as_float32(xp, t) for t in (g, u, s))
    elif fused.usable(xp, g, u, s, da):
        return fused.swiglu_backward(xp, g, u, s, da)
    du = g * s
    du *= da
    dg = 1.0 - s
    dg *= g
    dg += 1.0
    dg *= s
    dg *= u
    dg *= da
    return num.store_for_gemm(xp, dg), num.store_for_gemm(xp, du)


def swiglu_cache_elements(n: int) -> int:
    """Elements the forward caches for n outputs: g, u and sigmoid(g)."""
    return 3 * n
