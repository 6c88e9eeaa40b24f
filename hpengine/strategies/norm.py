"""The global gradient norm of every model, each parameter counted once whatever the layout: the one owner of
its reductions. It reads the reduction groups (layout/reduction.py): what this rank leaves out (copies, tp
replicas), what is summed over expert-parallel ranks, then sums over the owners, the pipeline and tp."""
from __future__ import annotations

import numpy as np

from hpengine.layout.reduction import expert_sums, norm_excluded
from hpengine.optim.clip import sum_of_squares


class GlobalNorm:
    """norms(g) for the owned gradient g (float32 or wider, unscaled) of the models in `slots`."""

    def __init__(self, layout, reds, owned, comms, xp, sharded: bool):
        self.owned, self.xp = owned, xp
        self.exclude = [layout.ranges[n] for n in norm_excluded(reds)]
        self.experts = [layout.ranges[n] for n in expert_sums(reds)]
        # the owned ranges differ over sharding, the stages over pp, the tp slices over tp
        self.over = ([comms["sharding"]] if sharded else []) + [comms["pp"], comms["tp"]]
        self.ep = comms.get("ep") if self.experts else None

    def norms(self, g, slots) -> list[float]:
        own = self.owned
        sq = [self._sumsq(g, own.intersect(s.range)) for s in slots]
        if self.experts:        # each ep rank holds other experts: their squares are summed over ep
            ex = [sum(self._sumsq(g, own.intersect(r)) for r in self.experts if s.range.start <= r.start
                      < s.range.stop) for s in slots]
            sq = [a - b + c for a, b, c in zip(sq, ex, self.ep.allreduce_(np.array(ex, dtype=np.float64)))]
        sq = np.array(sq, dtype=np.float64)
        for c in self.over:
            sq = c.allreduce_(sq)
        return [float(np.sqrt(v)) for v in sq]

    def here(self, g, slots) -> float:
        """This rank's squares of every model before any sum (which rank saw a non-finite gradient)."""
        return float(sum(self._sumsq(g, self.owned.intersect(s.range)) for s in slots))

    def _sumsq(self, g, r):
        """Squared norm of the owned gradient in r, counting excluded ranges (copies, tp replicas) zero times."""
        if r is None:
            return 0.0
        own = self.owned
        total = sum_of_squares(self.xp, g[r.start - own.start:r.stop - own.start])
        for ex in self.exclude:
            cut = ex.intersect(r)
            if cut is not None:
                total -= sum_of_squares(self.xp, g[cut.start - own.start:cut.stop - own.start])
        return total
