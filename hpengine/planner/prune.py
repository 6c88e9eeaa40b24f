"""The planner's branch and bound: the layouts of space.candidates grouped into families that share everything
but the sharding x dp split and the ZeRO stage, each family's floors (planner/bound.py) computed once, families
visited from the lowest time floor up, and a family skipped whole when its floor cannot beat what is already
ranked or cannot fit; the result's first `top` rows equal the exhaustive search's.
"""
from __future__ import annotations

import bisect
import functools
import logging
from dataclasses import dataclass
from itertools import product

from hpengine.layout.degrees import AmpPolicy, BatchSplit, Degrees, PipelinePlan
from hpengine.layout.resolve import Resolved
from hpengine.layout.schedules import schedule
from hpengine.planner.bound import family_floor, leaf_memory_floor, quick_floor
from hpengine.planner.calibrate import GB
from hpengine.planner.model import predict_layout
from hpengine.planner import space
from hpengine.planner.space import rank_key
from hpengine.planner.stages import stages

log = logging.getLogger(__name__)
# a family is skipped only when its floor exceeds the bar by more than this: the ranking rounds step times
# to 1e-9 s, and the floor sums the same terms in another order (a few ulps)
SLACK = 1e-8


@dataclass
class Family:
    """Layouts alike but for sharding x dp and the ZeRO stage: `rep` one of them; `leaves()` all of them, each
    with its place in space.candidates' order (the tie-break of the ranking)."""
    rep: Resolved
    size: int
    make: object
    stages: list           # stages.stages of the family's cut
    floor: tuple = (0.0, 0.0)

    def leaves(self):
        return self.make()


def families(cfg, cluster, max_rows: int, where=None, attention: float = 1.0):
    """Every family of space.candidates, enumerated by the same helpers; attention: StageFacts.attention."""
    m, W, gb = cfg.model, cluster.world, cfg.train.global_batch
    tps = [t for t in space.divisors(W) if t <= cluster.gpus_per_node and space.tp_ok(m, t)]
    modes, split_sends = space.recompute_modes(m), cfg.strategy.pipeline.scatter_gather
    comm, order = cfg.strategy.context_parallel.comm, tuple(cfg.mesh.order)
    bucket = cfg.strategy.data_parallel.bucket_mb
    prefixes = [(t, c, p) for t in tps for c in space.context_degrees(m, W // t)
                for p in space.divisors(W // (t * c)) if p <= m.n_layers]
    for i, (tp, cp, pp) in enumerate(prefixes):
        rest = W // (tp * cp * pp)
        if gb % rest or (where and not where(tp, cp, pp)):
            continue
        share, shs = gb // rest, space.divisors(rest)
        tensors = min(len(st.sizes(cfg.train.models)) for st in stages(m, tp, pp, 1))
        sps = (False, True) if tp > 1 and (m.seq_len // cp) % tp == 0 else (False,)
        rows = [r for r in space.divisors(share) if r <= max_rows]
        eps = sorted({e for sh in shs for e in space.expert_degrees(m, rest // sh, sh, cfg.optim.name)})
        cuts = {}               # the prefix's stage lists by (v, zbv, ep): stages() keys the model afresh each call
        for (bi, b), (mi, (rc, gran)), (ai, amp), (si, sp) in product(enumerate(rows), enumerate(modes),
                                                                      enumerate(("", "float16")), enumerate(sps)):
            if cp > 1 and gran == "selective":
                continue
            n = share // b
            for (ci, (sched, v)), ep in product(enumerate(space.schedules(pp, n, m.n_layers)), eps):
                fixed = dict(tp=tp, pp=pp, rest=rest, tensors=tensors, m=n if pp > 1 else 1, k=1 if pp > 1 else n,
                             v=v, schedule=sched, recompute=rc, amp=amp, order=order, share=share, bucket_mb=bucket,
                             granularity=gran, sp=sp, scatter=tp > 1 and pp > 1 and not sp and split_sends, ep=ep,
                             cp=cp, cp_comm=comm, optimizer=cfg.optim.name,
                             muon_ns_steps=cfg.optim.muon_ns_steps)
                split = tuple((hi, sh) for hi, sh in enumerate(shs)
                              if ep in space.expert_degrees(m, rest // sh, sh, cfg.optim.name))
                cut = (v, schedule(sched).vee, ep)
                if cut not in cuts:
                    cuts[cut] = stages(m, tp, pp, v, "uniform", sched, ep, attention)
                yield Family(_leaf(fixed, 1, 0), sum(1 if sh == 1 else 3 for _, sh in split),
                             functools.partial(_leaves, fixed, split, (i,), (bi, mi, ai, si, ci, ep)), cuts[cut])


def _leaf(f: dict, sh: int, zstage: int) -> Resolved:
    return Resolved(Degrees(f["tp"], f["cp"], sh, f["rest"] // sh, f["pp"], f["ep"], f["order"]),
                    PipelinePlan(f["m"], f["v"], f["schedule"], "uniform", f["scatter"]), AmpPolicy(f["amp"]),
                    BatchSplit(f["share"], f["k"]), zstage=zstage,
                    partition="tensor" if sh <= f["tensors"] else "flat", bucket_mb=f["bucket_mb"],
                    recompute=f["recompute"], granularity=f["granularity"], sp=f["sp"], cp_comm=f["cp_comm"],
                    optimizer=f["optimizer"], muon_ns_steps=f["muon_ns_steps"])


def _leaves(fixed: dict, split: tuple, head: tuple, tail: tuple):
    """The family's layouts with their places in candidates' order: (prefix, sh, zstage, rows, recompute, amp,
    sp, schedule, ep), the nesting of its loops."""
    for hi, sh in split:
        for zi, zstage in enumerate([0] if sh == 1 else [1, 2, 3]):
            yield head + (hi, zi) + tail, _leaf(fixed, sh, zstage)


class SearchProgress:
    """What the search reports as it goes (the command line draws it): layouts searched and pruned so far."""
    def start(self, total: int) -> None:
        pass

    def update(self, searched: int, pruned: int) -> None:
        pass


def branch_and_bound(cfg, cluster, max_rows: int, top: int, progress: SearchProgress | None = None,
                     where=None, attention: float = 1.0) -> tuple:
    """(layouts that fit, ranked as search ranks them, the first `top` equal to the exhaustive search's; how many
    were evaluated; how many were pruned unevaluated; the smallest layout when none fits).

    Why nothing better is pruned: a family is skipped when a memory floor of it (bound.quick_floor's, then
    family_floor's) exceeds the usable memory (no layout of it fits), or when `top` layouts that fit are ranked
    and a time floor of it exceeds the top-th one's step time by more than SLACK (each of its layouts ranks after
    those `top`; a later layout that fits only lowers that bar). Families are visited from the lowest quick
    time floor up, so once that floor is over the bar, so are all after it."""
    progress = progress or SearchProgress()
    usable, ids = cluster.usable_gb * GB, lambda lay: (0, 1, lay.pp - 1)
    fams = []
    for fam in families(cfg, cluster, max_rows, where, attention):
        fam.floor = quick_floor(cfg, fam.rep, cluster, ids(fam.rep), fam.stages)
        fams.append(fam)
    progress.start(sum(f.size for f in fams))
    fams.sort(key=lambda f: f.floor[0])
    fit, evaluated, pruned = [], 0, 0
    for j, fam in enumerate(fams):
        bar = fit[top - 1][0][0] + SLACK if len(fit) >= top else float("inf")
        if fam.floor[0] > bar:          # and so are the floors of every family after it
            rest = sum(f.size for f in fams[j:])
            pruned += rest
            progress.update(0, rest)
            break
        if fam.floor[1] <= usable:
            fam.floor = family_floor(cfg, fam.rep, cluster, ids(fam.rep), fam.stages, bar)
        if fam.floor[1] > usable or fam.floor[0] > bar:
            pruned += fam.size
            progress.update(0, fam.size)
            continue
        done = 0
        for order, lay in fam.leaves():
            if leaf_memory_floor(cfg, lay, cluster, ids(lay), fam.stages) > usable:
                continue
            r = predict_layout(cfg, lay, cluster, ids(lay), fam.stages)
            done += 1
            if r["memory"]["total"] <= usable:
                bisect.insort(fit, (rank_key(r) + (order,), r), key=lambda x: x[0])
        evaluated, pruned = evaluated + done, pruned + fam.size - done
        progress.update(done, fam.size - done)
    log.info("plan: %d layouts evaluated, %d pruned", evaluated, pruned)
    return [r for _, r in fit], evaluated, pruned, (None if fit else smallest_layout(cfg, cluster, fams))


def smallest_layout(cfg, cluster, fams: list) -> dict:
    """The layout that needs the least memory per device (the first in space.candidates' order among equals),
    for "no layout fits": families from the lowest memory floor up, until a floor exceeds the smallest found
    (a family's floor is quick_floor's or family_floor's, both floors)."""
    best = None
    for fam in sorted(fams, key=lambda f: f.floor[1]):
        if best is not None and fam.floor[1] > best[0][0]:
            break
        for order, lay in fam.leaves():
            r = predict_layout(cfg, lay, cluster, (0, 1, lay.pp - 1), fam.stages)
            if best is None or (r["memory"]["total"], order) < best[0]:
                best = ((r["memory"]["total"], order), r)
    return best[1]
