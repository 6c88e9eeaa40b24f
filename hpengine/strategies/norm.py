"""The global gradient norm of every model, each parameter counted once whatever the layout: the one owner of
its reductions. It reads the reduction groups (layout/reduction.py): what this rank leaves out (copies, tp
replicas), what is summed over expert-parallel ranks, then sums over the owners, the pipeline and tp."""
from __future__ import annotations

import numpy as np

from hpengine.layout.reduction import expert_sums, norm_excluded
from hpengine.optim.clip import sum_of_squares
from hpengine.params.buffers import cut


class GlobalNorm:
    """norms(g) for the owned gradient g (float32 or wider, unscaled) of the models in `slots`."""

    def __init__(self, layout, reds, parts, comms, xp, sharded: bool, experts_whole: bool = False):
        self.parts, self.xp = parts, xp
        self.exclude = [layout.ranges[n] for n in norm_excluded(reds)]
        self.experts = [layout.ranges[n] for n in expert_sums(reds)]
        # the owned ranges differ over sharding, the stages over pp, the tp slices over tp
        self.over = ([comms["sharding"]] if sharded else []) + [comms["pp"], comms["tp"]]
        self.ep = comms.get("ep") if self.experts else None
        # experts kept whole on every rank that holds them (ep across sharding): their squares are summed over
        # ep only, the rest over the sharding owners
        self.sh = comms["sharding"] if experts_whole and self.experts and sharded else None

    def norms(self, g, slots) -> list[float]:
        sq = [self._sumsq(g, s.range) for s in slots]
        over = self.over
        if self.experts:        # each ep rank holds other experts: their squares are summed over ep
            ex = [sum(self._sumsq(g, r) for r in self.experts if s.range.start <= r.start
                      < s.range.stop) for s in slots]
            total = self.ep.allreduce_(np.array(ex, dtype=np.float64))
            if self.sh is not None:
                dense = self.sh.allreduce_(np.array([a - b for a, b in zip(sq, ex)], dtype=np.float64))
                sq, over = list(dense + total), over[1:]
            else:
                sq = [a - b + c for a, b, c in zip(sq, ex, total)]
        sq = np.array(sq, dtype=np.float64)
        for c in over:
            sq = c.allreduce_(sq)
        return [float(np.sqrt(v)) for v in sq]

    def here(self, g, slots) -> float:
        """This rank's squares of every model before any sum (which rank saw a non-finite gradient)."""
        return float(sum(self._sumsq(g, s.range) for s in slots))

    def _sumsq(self, g, r):
        """Squared norm of the owned gradient in flat Range r, counting excluded ranges (copies, tp replicas)
        zero times."""
        total = 0.0
        for hit, at in cut(self.parts, r):
            total += sum_of_squares(self.xp, g[at:at + hit.size])
            for ex in self.exclude:
                c = ex.intersect(hit)
                if c is not None:
                    total -= sum_of_squares(self.xp, g[at + c.start - hit.start:at + c.stop - hit.start])
        return total
