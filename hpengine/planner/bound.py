"""Floors under a family of layouts for the planner's branch and bound (planner/prune.py): the step time and the
memory per device that no layout of the family can go below, from what the family fixes (tp, cp, pp, micro-batch,
recompute, amp, sequence parallel, schedule, ep) whatever its sharding x data-parallel split and ZeRO stage.
"""
from __future__ import annotations

import dataclasses
import math

from hpengine.layout.resolve import Resolved
from hpengine.planner import model as pm
from hpengine.planner.memory import activations, held_grad_bytes, model_state, packed_caches, precision
from hpengine.planner.stages import stages

SPLIT = ("sharding", "dp")        # the axes a family leaves open (only their product is fixed)


def floor_link(lay: Resolved, axis: str, cluster, op: str = "allreduce") -> tuple:
    """model.link of the axis where it does not depend on the open split: the axes inside it (mesh order) hold
    both or neither of sharding and dp, so their product, fixed by the family, sets the stride. Otherwise the
    best link there is (inside a node: the lower latency and higher bandwidth load_cluster enforces), no
    better than any layout's."""
    inner = set(lay.order[:lay.order.index(axis)])
    if axis in SPLIT or len(inner & set(SPLIT)) == 1:
        return cluster.intra_latency_us * 1e-6, ({"reduce": cluster.reduce_bw_gbs, "allgather":
                                                  cluster.allgather_bw_gbs}.get(op, 0.0) or cluster.intra_bw_gbs) * 1e9
    return pm.link(lay, axis, cluster, op)


def _floor_link(lay, axis, cluster, op="allreduce"):
    return floor_link(lay, axis, cluster, op)


def quick_floor(cfg, lay: Resolved, cluster, stage_ids, sts=None) -> tuple:
    """(seconds, bytes): cheaper and lower floors than family_floor's, to order the families and skip most of
    them before family_floor is computed. Why they are floors: compute_s never falls when layers are recomputed
    (more GEMM calls, FLOPs, block passes and element-wise bytes, the rest unchanged), so the compute of the
    same micro-batch without recompute is one, memoised on the stage and shared by every recompute mode and
    schedule; pp as in family_floor; tp, cp, ep and the sync left out (>= 0). Memory: the model states' floor
    of family_floor alone."""
    m, M = cfg.model, cfg.train.models
    sts = sts or stages(m, lay.tp, lay.pp, lay.v, lay.split, lay.schedule, lay.ep)
    packed = packed_caches(lay, cluster)
    w, g, k, item = precision(m, lay.amp, packed, lay.optimizer, least=True)    # k: a floor per element
    per_elem = w + held_grad_bytes(m, lay, packed) + k
    plain = dataclasses.replace(lay, recompute=0, granularity="full") if lay.recompute else lay
    t_mb, mem = 0.0, 0.0
    for s in sorted({s for s in stage_ids if 0 <= s < lay.pp}):
        st = sts[s]
        t_mb = max(t_mb, pm._compute_total(m, st, plain, M, cluster) + pm._pp_s(m, st, lay, s, M, cluster, _floor_link))
        mem = max(mem, per_elem * st.psi * M / (lay.sh * lay.dp))
    f = pm._bubble(lay.schedule, lay.pp, lay.m, lay.v) if lay.pp > 1 else 0.0
    return lay.k * (lay.m * t_mb / (1 - f)), mem


def family_floor(cfg, lay: Resolved, cluster, stage_ids, sts=None, bar: float = math.inf) -> tuple:
    """(seconds, bytes): floors under the step time and the worst stage's memory of every layout that differs
    from `lay` only in sharding x dp (their product fixed), the ZeRO stage and the partition.

    Why they are floors. Step time (model.step_time) = k * m * t_mb / (1 - bubble) + the exposed dp and sharding
    sync + fixed, t_mb the largest over the stages of compute + tp + pp + ep + cp per micro-batch, every term >= 0.
    Here: compute, pp and cp exactly as stage_times computes them (they read none of sh, dp, zstage, partition;
    links through floor_link, never better than the layout's), tp with the once-a-step sum of the replicated
    tensors' gradients left out (the only tp bytes that depend on the sharding share; tp_seconds grows with the
    bytes and its call count does not read them), ep and the sync left out (>= 0). The bubble and k, m are the
    family's. Memory (the worst evaluated stage, so at least any one stage's): the activations exactly (they read
    none of the open fields), the buffers left out (>= 0), and the model states at their least: every ZeRO stage
    holds at least bytes-per-element x the owned share of each of parameters, gradients and optimizer state, and
    the largest share of psi split over sh <= sh x dp ranks is at least psi / (sh x dp). When the time floor is
    over `bar` already, the memory floor is left at 0 (still a floor) and not computed."""
    m, M = cfg.model, cfg.train.models
    sts = sts or stages(m, lay.tp, lay.pp, lay.v, lay.split, lay.schedule, lay.ep)
    packed = packed_caches(lay, cluster)
    w, g, k, item = precision(m, lay.amp, packed, lay.optimizer, least=True)    # k: a floor per element
    per_elem = w + held_grad_bytes(m, lay, packed) + k
    rest = lay.sh * lay.dp
    t_mb, mem, ids = 0.0, 0.0, sorted({s for s in stage_ids if 0 <= s < lay.pp})
    for s in ids:
        st = sts[s]
        comp = pm._compute_total(m, st, lay, M, cluster)
        t = comp + pm._pp_s(m, st, lay, s, M, cluster, _floor_link)
        if lay.cp > 1:
            t += pm._cp_s(m, st, lay, M, comp, cluster, _floor_link)
        if lay.tp > 1:
            tp_bytes = pm.plan_tp.traffic(m, st, lay, lay.share * m.seq_len // lay.cp * M, item, g,
                                          4 if lay.amp else item, pm.F64 * M, 0, packed and lay.amp == "bfloat16")
            gathered = pm._split_gathered(m, lay, s, M, cluster)
            if gathered:
                tp_bytes["allgather"] = tp_bytes.get("allgather", 0) + gathered
            t += pm._tp_s(m, st, lay, M, tp_bytes, gathered, lambda op: floor_link(lay, "tp", cluster, op))
        t_mb = max(t_mb, t)
    f = pm._bubble(lay.schedule, lay.pp, lay.m, lay.v) if lay.pp > 1 else 0.0
    step = lay.k * (lay.m * t_mb / (1 - f))
    if step > bar:                  # pruned for time: the memory floor is not needed (0 is one)
        return step, 0.0
    for s in ids:
        mem = max(mem, activations(m, sts[s], lay, s, item, packed) + per_elem * sts[s].psi * M / rest)
    return step, mem


def leaf_memory_floor(cfg, lay: Resolved, cluster, stage_ids, sts) -> float:
    """A floor under one layout's memory (the worst evaluated stage): its model states and activations exactly,
    the buffers (>= 0) left out; both memoised, so a layout that cannot fit costs little."""
    m, M = cfg.model, cfg.train.models
    packed = packed_caches(lay, cluster)
    item = precision(m, lay.amp)[3]
    return max(sum(model_state(m, sts[s], lay, M, None, packed).values())
               + activations(m, sts[s], lay, s, item, packed)
               for s in sorted({s for s in stage_ids if 0 <= s < lay.pp}))
