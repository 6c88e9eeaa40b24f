"""AdamW (bias correction, decoupled weight decay, decay mask from the specs) over one Range of a
flat buffer. The sharding strategy runs it on the owned range only; the moments it keeps cover just
that range, which is where the ZeRO memory saving comes from.
"""
from __future__ import annotations

import math

import numpy as np

from ..buffers import Range

# NumPy updates the range in chunks of this many elements: the dozen passes of the update then run
# over two small scratch vectors that stay in L2 instead of allocating range-sized temporaries.
CHUNK = 1 << 16


def decay_mask(layout, r: Range, xp, dtype):
    """1.0 where the element of range r belongs to a tensor with decay, else 0.0."""
    mask = np.zeros(r.size, dtype=dtype)
    for name, part, _ in layout.tensors_in(r):
        if layout.by_name[name].decay:
            mask[part.start - r.start:part.stop - r.start] = 1.0
    return xp.asarray(mask)


def decay_runs(layout, r: Range) -> list[tuple[int, int]]:
    """Maximal [start, stop) runs, relative to r, of elements whose tensor has weight decay."""
    runs: list[list[int]] = []
    for name, part, _ in layout.tensors_in(r):
        if layout.by_name[name].decay:
            a, b = part.start - r.start, part.stop - r.start
            if runs and runs[-1][1] == a:
                runs[-1][1] = b
            else:
                runs.append([a, b])
    return [(a, b) for a, b in runs]


def _chunks(size: int, chunk: int, runs) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """(start, stop, decay runs inside it, relative to start) for each chunk of [0, size)."""
    out = []
    for i in range(0, size, chunk):
        j = min(i + chunk, size)
        out.append((i, j, [(max(a, i) - i, min(b, j) - i) for a, b in runs if a < j and b > i]))
    return out


class AdamW:
    """State (m, v, step count) for the elements of one owned range."""

    def __init__(self, xp, layout, r: Range, dtype, betas, eps, weight_decay):
        self.xp, self.range = xp, r
        self.m = xp.zeros(r.size, dtype=dtype)
        self.v = xp.zeros(r.size, dtype=dtype)
        self.runs = decay_runs(layout, r)
        self.b1, self.b2 = betas
        self.eps, self.wd = eps, weight_decay
        self.t = 0
        # on a GPU one pass over the whole range is cheapest (each chunk would be a kernel launch)
        chunk = min(CHUNK, r.size) if xp is np else r.size
        self._chunks = _chunks(r.size, max(chunk, 1), self.runs)
        self._scratch = (xp.empty(chunk, dtype=dtype), xp.empty(chunk, dtype=dtype))

    def nbytes(self) -> int:
        return self.m.nbytes + self.v.nbytes

    def step(self, p, g, lr: float, grad_coef: float = 1.0) -> None:
        """Update p (this range of the parameters, in place) from g (its gradient, scaled by
        grad_coef: clipping and loss-scale undo folded into one multiply)."""
        xp = self.xp
        self.t += 1
        b1, b2 = self.b1, self.b2
        c1, c2 = (1.0 - b1) * grad_coef, (1.0 - b2) * grad_coef * grad_coef
        # lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) == (lr*sqrt(bc2)/bc1) * m / (sqrt(v) + eps*sqrt(bc2))
        sb2 = math.sqrt(1.0 - b2 ** self.t)
        step_size, eps = lr * sb2 / (1.0 - b1 ** self.t), self.eps * sb2
        keep = 1.0 - lr * self.wd      # decoupled decay of the pre-update weights
        s1, s2 = self._scratch
        for i, j, runs in self._chunks:
            k = j - i
            gc, mc, vc, pc, a, b = g[i:j], self.m[i:j], self.v[i:j], p[i:j], s1[:k], s2[:k]
            xp.multiply(gc, c1, out=a)
            mc *= b1
            mc += a
            xp.multiply(gc, gc, out=b)
            b *= c2
            vc *= b2
            vc += b
            xp.sqrt(vc, out=b)
            b += eps
            xp.divide(mc, b, out=b)
            b *= step_size
            if self.wd:
                for ra, rb in runs:
                    pc[ra:rb] *= keep
            pc -= b
