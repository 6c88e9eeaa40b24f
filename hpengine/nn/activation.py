"""Point-wise activations: GELU (GPT-2 tanh approximation) and ReLU.

Constants are Python floats so float32/float16 inputs are never upcast.
"""
import contextlib
import math

import numpy as np

from . import fused


def _no_overflow_warning(xp):
    return np.errstate(over="ignore") if xp is np else contextlib.nullcontext()

_K = math.sqrt(2.0 / math.pi)
_A = 0.044715


def gelu_forward(xp, x):
    # x: (...) -> y: (...); y = 0.5 x (1 + tanh(u)), u = K (x + A x^3)
    # 0.5 (1 + tanh(u)) == sigmoid(2u): one exp is ~2x cheaper than tanh on CPU,
    # and avoids the cancellation in 1 + tanh(u) for negative x.
    if fused.usable(xp, x):
        y, s = fused.gelu_forward(xp, x)
        return y, (x, s)
    s = x * x
    s *= -2.0 * _A * _K
    s -= 2.0 * _K
    s *= x
    with _no_overflow_warning(xp):      # exp overflows to inf for very negative x: the sigmoid is then 0
        xp.exp(s, out=s)
    s += 1.0
    xp.reciprocal(s, out=s)
    return x * s, (x, s)


def gelu_backward(xp, dy, cache):
    # dy: (...) -> dx: (...)
    x, s = cache
    # with s = sigmoid(2u): dy/dx = s + 2 x s (1 - s) K (1 + 3 A x^2)
    if fused.usable(xp, x, s, dy):
        return fused.gelu_backward(xp, x, s, dy)
    d = x * x
    d *= 6.0 * _A * _K
    d += 2.0 * _K
    d *= x
    d *= 1.0 - s
    d += 1.0
    d *= s
    d *= dy
    return d


def gelu_recompute(xp, cache):
    # -> y: exactly the array gelu_forward returned (same ops, same order)
    x, s = cache
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
