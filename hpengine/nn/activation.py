"""Point-wise activations: GELU (GPT-2 tanh approximation) and ReLU.

Constants are Python floats so float32/float16 inputs are never upcast.
"""
import contextlib
import math

import numpy as np

from hpengine.device.bf16_bits import as_float32
from hpengine.nn import fused
from hpengine.nn.numerics import OFF


def _no_overflow_warning(xp):
    return np.errstate(over="ignore") if xp is np else contextlib.nullcontext()

_K = math.sqrt(2.0 / math.pi)
_A = 0.044715
# |x| beyond which sigmoid(2u) rounds to exactly 0 or 1 even in float64 (2u > 1900 > 745, where exp(-2u)
# is below the smallest subnormal); 30^3 is still finite in float16
_SAT = 30.0


def gelu_forward(xp, x, num=OFF):
    # x: (...) -> y: (...); y = 0.5 x (1 + tanh(u)), u = K (x + A x^3)
    # num.stores (nn/numerics.py): x is a GEMM's output stored in bfloat16 (num.product_stored) and only GEMMs
    # read y: s and y are stored as the GEMMs take them (bits when packed), y made from the s stored, so
    # gelu_recompute rebuilds it bit for bit
    # 0.5 (1 + tanh(u)) == sigmoid(2u) = 1 / (1 + exp(-2u)): it avoids the cancellation in 1 + tanh(u) for
    # negative x. Where exp(-2u) overflows to inf the sigmoid is 1 / inf = 0, its value to the dtype's
    # precision (below the smallest normal number); the overflow is expected there and not reported.
    # 1 / s is np.divide(1.0, s): the same IEEE quotient as np.reciprocal, twice as fast in NumPy 2.
    if num.stores:
        if fused.bits_usable(xp, x):
            y, s = fused.gelu_forward(xp, x)            # bits in, bits out
            return y, (x, s)
        s = num.store_for_gemm(xp, _sigmoid2u(xp, as_float32(xp, x)))
        return gelu_recompute(xp, (x, s), num), (x, s)
    if fused.usable(xp, x):
        y, s = fused.gelu_forward(xp, x)
        return y, (x, s)
    if x.dtype.itemsize < 4:
        return _gelu_forward_half(xp, x)
    s = _sigmoid2u(xp, x)
    return x * s, (x, s)


def _sigmoid2u(xp, x):
    s = x * x
    s *= -2.0 * _A * _K
    s -= 2.0 * _K
    s *= x                              # z = -2u
    with _no_overflow_warning(xp):
        xp.exp(s, out=s)
    s += 1.0
    xp.divide(1.0, s, out=s)            # s = sigmoid(2u)
    return s


def _gelu_forward_half(xp, x):
    # float16: x^3 and exp(-2u) leave float16's range early, so the exponent is exp(-|2u|) only:
    # sigmoid(2u) = 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0, e = exp(-|2u|)
    t = xp.clip(x, -_SAT, _SAT)         # s is exactly 0 or 1 beyond; x^3 stays finite in float16
    s = t * t
    s *= -2.0 * _A * _K
    s -= 2.0 * _K
    s *= t                              # z = -2u
    neg = s > 0                         # x < 0
    xp.abs(s, out=s)
    xp.negative(s, out=s)
    xp.exp(s, out=s)                    # e = exp(-|2u|) in (0, 1]: never overflows
    r = s + 1.0
    xp.reciprocal(r, out=r)             # 1 / (1 + e): the sigmoid for x >= 0
    r *= xp.where(neg, s, 1.0)          # e / (1 + e) for x < 0
    return x * r, (x, r)


def gelu_backward(xp, dy, cache, num=OFF):
    # dy: (...) -> dx: (...)
    # num.stores: only GEMMs (and a bias gradient) read dx: stored as they take it (num.store_for_gemm; from
    # gelu_forward's bits cache the kernel writes the bits itself)
    x, s = cache
    # with s = sigmoid(2u): dy/dx = s + 2 x s (1 - s) K (1 + 3 A x^2)
    if num.stores and fused.bits_usable(xp, x, s) and dy.dtype == xp.float32:  # the bits cache
        return fused.gelu_backward(xp, x, s, dy)
    x, s = as_float32(xp, x), as_float32(xp, s)
    if fused.usable(xp, x, s, dy):
        return num.store_for_gemm(xp, fused.gelu_backward(xp, x, s, dy))
    return num.store_for_gemm(xp, _gelu_backward(xp, x, s, dy))


def _gelu_backward(xp, x, s, dy):
    t = xp.clip(x, -_SAT, _SAT) if x.dtype.itemsize < 4 else x   # float16: keep x^3 finite; beyond
    d = t * t                                                     # _SAT, s (1 - s) is exactly 0 anyway
    d *= 6.0 * _A * _K
    d += 2.0 * _K
    d *= t
    d *= 1.0 - s
    d += 1.0
    d *= s
    d *= dy
    return d


def gelu_recompute(xp, cache, num=OFF):
    # -> y: exactly the array gelu_forward returned (same ops, same order)
    x, s = cache
    if num.stores:
        if fused.bits_usable(xp, x, s):
            return fused.gelu_recompute(xp, x, s)
        return num.store_for_gemm(xp, as_float32(xp, x) * as_float32(xp, s))
    return x * s


def relu_forward(xp, x):
    # x: (...) -> y: (...)
    return xp.maximum(x, 0), x > 0


def relu_backward(xp, dy, cache):
    # dy: (...) -> dx: (...)
    return dy * cache


def gelu_cache_elements(n: int) -> int:
    """Elements the forward caches for n inputs: the input and the sigmoid factor (the output is rebuilt)."""
    return 2 * n
