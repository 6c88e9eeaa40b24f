"""Plain SGD (p -= lr x g, decoupled weight decay of decayed tensors) over one Range of a flat buffer: no state.
Its update is linear in the gradient, which is what makes DiLoCo with one inner step, outer lr 1 and no momentum
the same run as data parallel over the islands; and a baseline.
"""
from __future__ import annotations

import numpy as np

from hpengine.device.bf16_bits import to_bf16_bits
from hpengine.device.precision import round_bf16_
from hpengine.optim.adamw import decay_runs
from hpengine.params.buffers import Range


def write_copy(xp, copy, p) -> None:
    """amp's compute copy of the float32 values p as the optimizers write it: float16, float32 holding the
    nearest bfloat16 values, or uint16 holding their bits."""
    if copy.dtype == np.uint16:
        copy[...] = to_bf16_bits(xp, p)
    else:
        copy[...] = p
        if copy.dtype == np.float32:
            round_bf16_(xp, copy)


class SGD:
    """Stateless SGD over the elements of one owned range."""
    STATE = ()

    def __init__(self, xp, layout, r: Range, dtype, weight_decay: float):
        self.xp, self.range, self.wd, self.t = xp, r, weight_decay, 0
        self.runs = decay_runs(layout, r)

    def nbytes(self) -> int:
        return 0

    def state(self) -> dict:
        return {}

    def state_at(self, a: int) -> dict:
        return {}

    def step(self, p, g, lr: float, grad_coef: float = 1.0, copy=None) -> None:
        self.t += 1
        dt = p.dtype.type
        if self.wd:
            keep = dt(1.0 - lr * self.wd)
            for a, b in self.runs:
                p[a:b] *= keep
        p -= dt(lr * grad_coef) * g
        if copy is not None:
            write_copy(self.xp, copy, p)
