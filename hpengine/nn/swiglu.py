"""SiLU gating, the middle of Llama's SwiGLU MLP: a = silu(g) * u with silu(g) = g * sigmoid(g).

The cache keeps g, u and s = sigmoid(g); the output a (the down projection's input) is rebuilt from
them in backward (two multiplies), a quarter less MLP activation memory than keeping it.
d/dg silu(g) = s (1 + g (1 - s)).
"""
from hpengine.nn import bf16_gemm, fused
from hpengine.nn.activation import _no_overflow_warning


def swiglu_forward(xp, g, u, gemm_input=False):
    # g, u: (...) -> a: (...)
    # gemm_input: only GEMMs read a (and dg, du in swiglu_backward, a in swiglu_recompute); under bf16 amp
    # each is stored as they take it (bf16_gemm.store_for_gemm)
    if fused.usable(xp, g, u):
        a, s = fused.swiglu_forward(xp, g, u, bits=_bits(xp, gemm_input, g))
        return _stored(xp, a, gemm_input), (g, u, s)
    s = xp.negative(g)
    with _no_overflow_warning(xp):      # exp overflows to inf for very negative g: the sigmoid is then 0
        xp.exp(s, out=s)
    s += 1.0
    xp.divide(1.0, s, out=s)            # np.reciprocal's quotient, twice as fast in NumPy 2
    a = g * s
    a *= u
    return _stored(xp, a, gemm_input), (g, u, s)


def swiglu_recompute(xp, cache, gemm_input=False):
    # -> exactly the array swiglu_forward returned (same ops, same order)
    g, u, s = cache
    a = g * s
    a *= u
    return _stored(xp, a, gemm_input)


def swiglu_backward(xp, da, cache, gemm_input=False):
    # da: (...) -> (dg, du)
    g, u, s = cache
    if fused.usable(xp, g, u, s, da):
        dg, du = fused.swiglu_backward(xp, g, u, s, da, bits=_bits(xp, gemm_input, g))
        return _stored(xp, dg, gemm_input), _stored(xp, du, gemm_input)
    du = g * s
    du *= da
    dg = 1.0 - s
    dg *= g
    dg += 1.0
    dg *= s
    dg *= u
    dg *= da
    return _stored(xp, dg, gemm_input), _stored(xp, du, gemm_input)


def _bits(xp, gemm_input, g):
    # whether the fused kernel writes its GEMM-bound outputs as bfloat16 bits itself
    return gemm_input and bf16_gemm.writes_bits() and g.dtype == xp.float32


def _stored(xp, y, gemm_input):
    return bf16_gemm.store_for_gemm(xp, y) if gemm_input else y


def swiglu_cache_elements(n: int) -> int:
    """Elements the forward caches for n outputs: g, u and sigmoid(g)."""
    return 3 * n
