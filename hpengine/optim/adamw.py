"""AdamW (bias correction, decoupled weight decay, decay mask from the specs) over one Range of a
flat buffer. The sharding strategy runs it on the owned range only; the moments it keeps cover just
that range, which is where the ZeRO memory saving comes from. The arithmetic lives in kernels.py: the
fused RawKernel on a GPU, its NumPy twin on the CPU (same operations, same order, same bits).
"""
from __future__ import annotations

import numpy as np

from hpengine.device.kernels import (
    CHUNK,
    adamw_coefs,
    adamw_cupy,
    adamw_numpy,
    chunk_plan,
)
from hpengine.params.buffers import Range


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


def _aligned_like(xp, a, ref):
    """A copy of device array a whose address has ref's offset from a 16-byte boundary, so the fused
    kernel can use vector loads on both (allocations themselves are 256-byte aligned)."""
    k = (ref.data.ptr % 16) // a.itemsize
    out = xp.empty(a.size + 16 // a.itemsize, dtype=a.dtype)[k:k + a.size]
    out[...] = a
    return out


class AdamW:
    """State (m, v, step count) for the elements of one owned range."""
    STATE = ("adam_m", "adam_v")      # the checkpoint's names of m and v

    def __init__(self, xp, layout, r: Range, dtype, betas, eps, weight_decay):
        self.xp, self.range = xp, r
        self.m = xp.zeros(r.size, dtype=dtype)
        self.v = xp.zeros(r.size, dtype=dtype)
        self.runs = decay_runs(layout, r)
        self.b1, self.b2 = betas
        self.eps, self.wd = eps, weight_decay
        self.t = 0
        # on a GPU (float32/float64) one fused kernel pass; elsewhere the NumPy twin over cache-sized
        # chunks (CuPy with another dtype: one chunk, each chunk costing a dozen launches)
        self.fused = xp is not np and np.dtype(dtype) in (np.float32, np.float64)
        self.mask = decay_mask(layout, r, xp, np.uint8) if self.fused else None
        chunk = min(CHUNK, r.size) if xp is np else r.size
        self._plan = chunk_plan(r.size, max(chunk, 1), self.runs)
        self._scratch = None if self.fused else (xp.empty(chunk, dtype=dtype), xp.empty(chunk, dtype=dtype))

    def nbytes(self) -> int:
        return self.m.nbytes + self.v.nbytes

    def state(self) -> dict:
        return dict(zip(self.STATE, (self.m, self.v)))

    def state_at(self, a: int) -> dict:
        return dict.fromkeys(self.STATE, a)       # both moments span the range

    def step(self, p, g, lr: float, grad_coef: float = 1.0, copy=None) -> None:
        """Update p (this range of the parameters, in place) from g (its gradient, scaled by
        grad_coef: clipping and loss-scale undo folded into one multiply). copy, when given, receives
        the updated weights in the same pass as amp's compute copy: float16, or float32 holding
        bfloat16 values."""
        self.t += 1
        c = adamw_coefs(self.t, lr, (self.b1, self.b2), self.eps, self.wd, grad_coef)
        if self.fused:
            if self.m.data.ptr % 16 != p.data.ptr % 16:
                self.m, self.v = _aligned_like(self.xp, self.m, p), _aligned_like(self.xp, self.v, p)
            adamw_cupy(p, g, self.m, self.v, self.mask, c, copy)
        else:
            adamw_numpy(p, g, self.m, self.v, None, c, copy, plan=self._plan, scratch=self._scratch)
