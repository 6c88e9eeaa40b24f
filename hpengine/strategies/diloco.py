"""DiLoCo's outer loop on this rank's owned part of the parameters: every inner_steps steps (per fragment, staggered
under streaming) the pseudo-gradient (outer - island parameters) is averaged over the islands on the replica
communicator (an allreduce, or quantised payloads all-gathered, with error feedback), the outer parameters take an
SGD step with (Nesterov) momentum, and the island restarts from them. The state is three arrays over the owned part.
"""
from __future__ import annotations

import numpy as np

from hpengine.optim.sgd import write_copy
from hpengine.strategies import quantize

STATE = ("outer_param", "outer_momentum", "outer_residual")     # the checkpoint's names


class Outer:
    """The outer state over this rank's owned part (n elements, in the dtype of what the optimizer updates)."""

    def __init__(self, dl, comm, xp, p0, fragments: list[list[tuple[int, int]]]):
        """dl: the [strategy.diloco] table; comm: the replica Comm; p0: the owned values the run starts from;
        fragments: per fragment, the (start, stop) slices of the owned array it holds here."""
        self.dl, self.comm, self.xp = dl, comm, xp
        self.H, self.M = dl.inner_steps, comm.size
        self.fragments = fragments
        self.param = p0.copy()
        self.momentum = xp.zeros_like(p0) if dl.outer_momentum > 0 else None
        self.residual = xp.zeros_like(p0) if dl.quantize != "none" else None
        self.steps = 0          # outer exchanges done (one per fragment synchronised)

    def due(self, step: int) -> list[int]:
        """The fragments synchronised after optimizer step `step` (0-based): fragment f when step + 1 + f H / F is
        a multiple of H (all of them every H steps when F = 1)."""
        F = len(self.fragments)
        return [f for f in range(F) if (step + 1 + f * self.H // F) % self.H == 0]

    def state(self) -> dict:
        return {k: a for k, a in zip(STATE, (self.param, self.momentum, self.residual)) if a is not None}

    def reset(self, p) -> None:
        """The outer parameters from the island's (a checkpoint without outer state: a fresh outer loop)."""
        self.param[...] = p
        for a in (self.momentum, self.residual):
            if a is not None:
                a[...] = 0

    def step(self, f: int, p, copy) -> tuple:
        """Fragment f's outer step: p (the owned values the optimizer updates) and amp's compute copy `copy` (or
        None) restart from the new outer parameters. Returns (the island's drift, the averaged pseudo-gradient),
        each over the whole owned array (zero outside the fragment), for the norms."""
        xp, dl, idx = self.xp, self.dl, self._index(f)
        drift = xp.zeros_like(p)
        avg = xp.zeros_like(p)
        delta = self._take(self.param, idx) - self._take(p, idx)
        self._put(drift, idx, delta)
        if dl.quantize == "none":
            self.comm.allreduce_(delta)
            mean = delta / p.dtype.type(self.M)
        else:
            v = delta + self._take(self.residual, idx)
            payload, seen = quantize.encode(xp, v, dl.quantize)
            self._put(self.residual, idx, v - seen)
            gathered = xp.empty(self.M * payload.size, dtype=np.uint8)
            gathered[self.comm.rank * payload.size:(self.comm.rank + 1) * payload.size] = payload
            self.comm.allgatherv_(gathered, [payload.size] * self.M, [i * payload.size for i in range(self.M)])
            mean = quantize.mean_of(xp, gathered, self.M, v.size, dl.quantize, v.dtype)
        self._put(avg, idx, mean)
        upd = mean
        if self.momentum is not None:     # PyTorch SGD: buf = mu buf + g; Nesterov: g + mu buf, else buf
            mu = p.dtype.type(dl.outer_momentum)
            buf = self._take(self.momentum, idx) * mu + mean
            self._put(self.momentum, idx, buf)
            upd = mean + mu * buf if dl.nesterov else buf
        new = self._take(self.param, idx) - p.dtype.type(dl.outer_lr) * upd
        self._put(self.param, idx, new)
        self._put(p, idx, new)
        if copy is not None:
            for a, b in idx:
                write_copy(xp, copy[a:b], p[a:b])
        self.steps += 1
        return drift, avg

    def _index(self, f: int) -> list[tuple[int, int]]:
        return self.fragments[f]

    def _take(self, a, idx):
        if len(idx) == 1:
            return a[idx[0][0]:idx[0][1]].copy()
        return self.xp.concatenate([a[s:e] for s, e in idx]) if idx else a[:0].copy()

    @staticmethod
    def _put(a, idx, v) -> None:
        at = 0
        for s, e in idx:
            a[s:e] = v[at:at + e - s]
            at += e - s


def fragment_slices(parts, stage_range, fragments: int) -> list[list[tuple[int, int]]]:
    """Per fragment, the (start, stop) slices of the owned array (parts: (flat Range, offset) pieces) that fall in
    it; fragment f is the f-th of `fragments` equal element ranges of the stage's flat buffer (stage_range)."""
    lo, n = stage_range.start, stage_range.size
    out = []
    for f in range(fragments):
        a, b = lo + f * n // fragments, lo + (f + 1) * n // fragments
        out.append([(at + max(a, r.start) - r.start, at + min(b, r.stop) - r.start)
                    for r, at in parts if max(a, r.start) < min(b, r.stop)])
    return out
