"""Plain SGD (p -= lr x g, decoupled weight decay of decayed tensors) over one Range of a flat buffer: no state.
Its update is linear in the gradient, which is what makes DiLoCo with one inner step, outer lr 1 and no momentum
the same run as data parallel over the islands; and a baseline.
"""
from __future__ import annotations

from hpengine.device.precision import write_copy
from hpengine.optim.adamw import decay_runs
from hpengine.params.buffers import Range


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
