"""AdamW (bias correction, decoupled weight decay, decay mask from the specs) over one Range of a
flat buffer. The sharding strategy runs it on the owned range only; the moments it keeps cover just
that range, which is where the ZeRO memory saving comes from.
"""
from __future__ import annotations

import numpy as np

from ..buffers import Range


def decay_mask(layout, r: Range, xp, dtype):
    """1.0 where the element of range r belongs to a tensor with decay, else 0.0."""
    mask = np.zeros(r.size, dtype=dtype)
    for name, part, _ in layout.tensors_in(r):
        if layout.by_name[name].decay:
            mask[part.start - r.start:part.stop - r.start] = 1.0
    return xp.asarray(mask)


class AdamW:
    """State (m, v, step count) for the elements of one owned range."""

    def __init__(self, xp, layout, r: Range, dtype, betas, eps, weight_decay):
        self.xp, self.range = xp, r
        self.m = xp.zeros(r.size, dtype=dtype)
        self.v = xp.zeros(r.size, dtype=dtype)
        self.mask = decay_mask(layout, r, xp, dtype)
        self.b1, self.b2 = betas
        self.eps, self.wd = eps, weight_decay
        self.t = 0

    def nbytes(self) -> int:
        return self.m.nbytes + self.v.nbytes

    def step(self, p, g, lr: float, grad_coef: float = 1.0) -> None:
        """Update p (this range of the parameters, in place) from g (its gradient, scaled by
        grad_coef: clipping and loss-scale undo folded into one multiply)."""
        xp, m, v = self.xp, self.m, self.v
        self.t += 1
        bc1 = 1.0 - self.b1 ** self.t
        bc2 = 1.0 - self.b2 ** self.t
        gs = g * grad_coef if grad_coef != 1.0 else g
        m *= self.b1
        m += (1.0 - self.b1) * gs
        v *= self.b2
        v += (1.0 - self.b2) * (gs * gs)
        denom = xp.sqrt(v)
        denom *= 1.0 / np.sqrt(bc2)
        denom += self.eps
        if self.wd:
            p -= (lr * self.wd) * self.mask * p   # decoupled decay, applied to the pre-update weights
        p -= (lr / bc1) * (m / denom)
