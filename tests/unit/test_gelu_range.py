"""GELU over the whole range of each dtype: no floating-point warning (overflow included) and the right
values, against the tanh formula in Python floats, for inputs far beyond what training normally sees."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from hpengine.nn.activation import gelu_backward, gelu_forward, gelu_recompute

K, A = math.sqrt(2.0 / math.pi), 0.044715
BIG = [-6e4, -1e4, -1000.0, -300.0, -100.0, -31.0, -30.0, -20.0, -10.0, -3.0, -0.5, 0.0,
       0.5, 3.0, 10.0, 20.0, 30.0, 31.0, 100.0, 300.0, 1000.0, 1e4, 6e4]


def oracle(x: float) -> tuple[float, float]:
    """(gelu(x), gelu'(x)) of the tanh approximation in Python floats; the tails by their limits."""
    if x > 8:
        return x, 1.0
    if x < -8:
        return 0.0, 0.0
    u = K * (x + A * x ** 3)
    t = math.tanh(u)
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * K * (1 + 3 * A * x * x)


# float32: near x ~ -9.4, before exp(-2u) overflows and the sigmoid becomes exactly 0, the sigmoid is ~1e-38
# (float32's smallest normal), so the tail's derivative there, x^3 times that, is ~1e-35 where the oracle says 0
@pytest.mark.parametrize("dtype, rtol, atol", [(np.float64, 1e-12, 1e-30), (np.float32, 1e-6, 1e-24),
                                               (np.float16, 2e-3, 1e-6)])
def test_large_inputs_give_no_warning_and_the_right_values(dtype, rtol, atol):
    x = np.array(BIG, dtype)
    with warnings.catch_warnings(), np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is fine
        warnings.simplefilter("error")
        y, cache = gelu_forward(np, x)
        dx = gelu_backward(np, np.ones_like(x), cache)
        again = gelu_recompute(np, cache)
    assert y.dtype == dx.dtype == dtype
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx))
    assert np.array_equal(again, y)
    want = np.array([oracle(float(v)) for v in x])
    np.testing.assert_allclose(y.astype(np.float64), want[:, 0], rtol=rtol, atol=atol)
    np.testing.assert_allclose(dx.astype(np.float64), want[:, 1], rtol=rtol, atol=atol)
    assert np.all(y[x < 0] <= 0) and np.all(y[x > 30] == x[x > 30])


def test_the_negative_tail_keeps_its_tiny_values():
    """e / (1 + e) for x < 0 keeps relative accuracy where 1 + tanh(u) would cancel to 0."""
    x = np.array([-5.0, -8.0, -12.0])
    y, _ = gelu_forward(np, x)
    u = K * (x + A * x ** 3)
    want = x * np.exp(2 * u) / (1 + np.exp(2 * u))           # sigmoid(2u) written the other way round
    np.testing.assert_allclose(y, want, rtol=1e-13)
    assert y[-1] < 0
