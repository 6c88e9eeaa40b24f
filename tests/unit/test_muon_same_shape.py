"""optim.same_shape.by_shape, which runs Muon's Newton-Schulz once per shape on CuPy: in float64 its results equal
the per-stack calls bit for bit (NumPy multiplies a stack matrix by matrix), in the stacks' order, for mixed shapes,
single matrices and routed experts' stacks (one call a shape)."""
from __future__ import annotations

import numpy as np

from hpengine.optim.muon import newton_schulz
from hpengine.optim.same_shape import by_shape

QUINTIC = (3.4445, -4.775, 2.0315)


def _ns(stack):
    return np.swapaxes(newton_schulz(np, np.swapaxes(stack, -1, -2), QUINTIC, 5), -1, -2)


def test_grouped_iteration_equals_the_per_stack_calls_bit_for_bit():
    rng = np.random.default_rng(0)
    shapes = [(1, 24, 40), (4, 24, 40), (1, 40, 24), (2, 16, 16), (1, 24, 40), (1, 7, 3)]
    stacks = [rng.standard_normal(s) for s in shapes]
    calls = []
    got = by_shape(np, stacks, lambda s: calls.append(s.shape) or _ns(s))
    assert sorted(calls) == sorted([(6, 24, 40), (1, 40, 24), (2, 16, 16), (1, 7, 3)])
    for g, s in zip(got, stacks):
        assert g.shape == s.shape and np.array_equal(g, _ns(s))

