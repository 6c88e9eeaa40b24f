"""Muon's Newton-Schulz work in the planner's step time: the GEMMs optim/muon.py's newton_schulz runs per matrix,
which matrices each owner orthogonalises (`owner_matrices`, the one place that says how the work is divided) and
the seconds of the busiest owner's optimizer step, element-wise and Newton-Schulz together.
"""
from __future__ import annotations

import collections

from hpengine.optim.muon import ns_work
from hpengine.params.buffers import assign_owners
from hpengine.planner import gpu as plan_gpu
from hpengine.planner.memory import _partition, owned
from hpengine.planner.stages import StageFacts, memoised

NEWTON_SCHULZ = ("muon",)      # optimizers (optim.name) that orthogonalise their matrices by the iteration


def runs(lay) -> bool:
    """Whether the layout's optimizer runs the Newton-Schulz iteration."""
    return lay.optimizer in NEWTON_SCHULZ


# newton_schulz works on the wide orientation X (s x l, s = min(rows, cols), l = max): each iteration is
# A = X X^T (s x l x s), A A (s x s x s) and (b A + c A A) X (s x s x l), 2 m k n FLOPs each, so
# 4 s^2 l + 2 s^3 FLOPs; the element-wise terms (b A, c A A, their sum, a X and the add: 3 s^2 + 2 s l) and the
# Frobenius normalisation before the loop (3 s l) are memory passes, left to the element-wise figure.
def gemms(rows: int, cols: int, steps: int, count: int = 1) -> list[tuple]:
    """(calls, M, K, N, batch) of the GEMMs of `steps` iterations on `count` rows x cols matrices."""
    s, l = min(rows, cols), max(rows, cols)
    return [(steps, s, l, s, count), (steps, s, s, s, count), (steps, s, s, l, count)]


def flops(rows: int, cols: int, steps: int, count: int = 1) -> float:
    """FLOPs of the iteration's GEMMs: count x steps x (4 s^2 l + 2 s^3)."""
    return plan_gpu.gemm_flops(gemms(rows, cols, steps, count))


def owner_matrices(st: StageFacts, lay, models: int, sh_rank: int = 0) -> tuple:
    """((rows, cols), matrices) the busiest owner orthogonalises each step, as strategies/whole_tensors.py divides
    the work: every Muon matrix of the stage (of every sharding owner's range) gets one owner among the data-replica
    group, sharding x replicas (dp x cp) x tp; a routed expert stack split over ep: among its range's ep-dp replicas
    times tp; heaviest first to the least loaded (params.buffers.assign_owners). The busiest dense and the busiest
    expert share are added: an upper bound where they fall on two ranks."""
    sharded = _sharded(lay)
    key = ("muon owner", models, lay.sh if sharded else 1, lay.partition, sh_rank if sharded else 0, lay.dp, lay.cp,
           lay.ep, lay.tp)
    return memoised(st, key, lambda: _owner_matrices(st, lay, models, sh_rank if sharded else None))


def _owner_matrices(st: StageFacts, lay, models: int, sh_rank) -> tuple:
    shapes = [m for _ in range(models) for m in st.muon]
    store = _storage(st, lay, models)
    out = collections.Counter()
    for expert, replicas in ((False, lay.dp * lay.cp), (True, max(1, lay.dp // lay.ep))):
        hop = not expert and sh_rank is not None        # dense matrices: owners over the sharding ranks too
        items = [m for m, s in zip(shapes, store) if m is not None and _split(m, lay) == expert
                 and (hop or sh_rank is None or s == sh_rank)]
        if not items:
            continue
        work = [ns_work((count, rows, cols)) for count, rows, cols, _ in items]
        owners = assign_owners(work, (lay.sh if hop else 1) * replicas * lay.tp)
        loads = collections.Counter()
        for o, w in zip(owners, work):
            loads[o] += w
        busiest = max(sorted(loads), key=lambda o: loads[o])
        for m, o in zip(items, owners):
            if o == busiest:
                out[m[1:3]] += m[0]
    return tuple(sorted(out.items()))


def hop_elements(st: StageFacts, lay, models: int, sh_rank=None, replica=None) -> tuple[int, int]:
    """(elements, calls) of the sharding alltoallv of a step on the rank at sharding rank `sh_rank` and place
    `replica` among dp x cp (None: the rank with the most): per model whose matrices move, one alltoallv takes each
    update from its storage owner (the one at its work owner's place among the replicas) to its work owner and one
    brings the result back; each rank counts what it sends, its tp slice of each matrix."""
    if not _sharded(lay):
        return 0, 0
    key = ("muon hop", models, lay.sh, lay.partition, sh_rank, replica, lay.dp, lay.cp, lay.ep, lay.tp)
    return memoised(st, key, lambda: _hop_elements(st, lay, models, sh_rank, replica))


def _hop_elements(st: StageFacts, lay, models: int, sh_rank, replica) -> tuple[int, int]:
    sizes, store = st.sizes(models), _storage(st, lay, models)
    shapes = [m for _ in range(models) for m in st.muon]
    dense = [i for i, m in enumerate(shapes) if m is not None and not _split(m, lay)]
    D, T = lay.dp * lay.cp, lay.tp
    owners = assign_owners([ns_work(shapes[i][:3]) for i in dense], lay.sh * D * T)
    per, best = len(st.muon), (0, 0)
    for s in range(lay.sh) if sh_rank is None else [sh_rank]:
        for d in range(D) if replica is None else [replica]:
            elems = calls = 0
            for k in range(models):
                moving = [(i, o // (D * T)) for i, o in zip(dense, owners)
                          if i // per == k and o // T % D == d and o // (D * T) != store[i]]
                if moving:
                    calls += 2
                    elems += sum(sizes[i] for i, so in moving if s in (store[i], so))
            best = max(best, (elems, calls))
    return best


def _sharded(lay) -> bool:
    return lay.sh > 1 and lay.zstage >= 1


def _storage(st: StageFacts, lay, models: int) -> list[int]:
    """The sharding rank whose range holds each tensor (sizes' order; 0 unsharded)."""
    sizes = st.sizes(models)
    if not _sharded(lay):
        return [0] * len(sizes)
    ranges, at, out = _partition(sizes, lay.sh, lay.partition), 0, []
    for n in sizes:
        out.append(next(r for r, R in enumerate(ranges) if R.start <= at < R.stop) if n else 0)
        at += n
    return out


def owned_elements(st: StageFacts, lay, models: int, sh_rank=None) -> tuple[int, int]:
    """(dense, expert) elements of the Muon tensors of the owned range as this rank holds them (tp and ep slices):
    what the owners' results share over the replicas (dp x cp; experts: ep-dp) each step. sh_rank None: the
    sharding owner with the most."""
    sharded = lay.sh > 1 and lay.zstage >= 1
    ranks = [sh_rank or 0] if sh_rank is not None or not sharded else range(lay.sh)
    sizes = st.sizes(models)
    shapes = [m for _ in range(models) for m in st.muon]
    best = (0, 0)
    for r in ranks:
        rng, at, dense, expert = (_partition(sizes, lay.sh, lay.partition)[r] if sharded else None), 0, 0, 0
        for n, m in zip(sizes, shapes):
            if m is not None and (rng is None or rng.start <= at < rng.stop):
                dense, expert = (dense, expert + n) if _split(m, lay) else (dense + n, expert)
            at += n
        best = max(best, (dense, expert), key=sum)
    return best


def _split(m, lay) -> bool:
    """Whether a Muon matrix is a routed expert stack split over ep ranks (its work divided over ep-dp)."""
    return m[3] and lay.ep > 1


def ns_seconds(mcfg, st: StageFacts, lay, models: int, cluster, sh_rank: int = 0) -> float:
    """Seconds of this rank's Newton-Schulz GEMMs per step, in the dtype of the optimizer's master weights
    (float64 runs in float64, the rest in float32), at the cluster's GEMM rates (planner/gpu.py's shape model
    on a GPU cluster, else the sustained rate)."""
    f64 = not lay.amp and mcfg.dtype == "float64"
    peak = (cluster.tflops_fp64 if f64 else cluster.tflops_fp32) * 1e12
    calls = [g for (rows, cols), n in owner_matrices(st, lay, models, sh_rank)
             for g in gemms(rows, cols, lay.muon_ns_steps, n)]
    if not plan_gpu.enabled(cluster):
        return plan_gpu.gemm_flops(calls) / peak
    bw = cluster.mem_bw_gbs * 1e9
    return sum(c * plan_gpu.gemm_s(m, k, n, peak, 8 if f64 else 4, cluster.gemm_half_dim, cluster.gemm_eff_max, bw,
                                   cluster.launch_us * 1e-6, b) for c, m, k, n, b in calls)


def optimizer_seconds(mcfg, st: StageFacts, lay, models: int, cluster, k_bytes: int, sh_rank=None) -> float:
    """Seconds of the optimizer step on this rank (the busiest owner when sh_rank is None): its element-wise work
    over the owned elements (cluster.optimizer_ns, measured in float32: k_bytes / 8 of it) and its Newton-Schulz
    GEMMs."""
    sharded = lay.sh > 1 and lay.zstage >= 1
    ranks = [sh_rank or 0] if sh_rank is not None or not sharded else range(lay.sh)

    def one(r) -> float:
        own = owned(st, lay, models, r) if sharded else st.psi * models
        return cluster.optimizer_ns * 1e-9 * own * k_bytes / 8 + ns_seconds(mcfg, st, lay, models, cluster, r)
    # the search asks for the same figure for many layouts (every schedule, micro-batch size, recompute mode)
    key = ("muon seconds", models, lay.sh if sharded else 1, lay.partition, sh_rank if sharded else 0, k_bytes,
           lay.muon_ns_steps, lay.amp, mcfg.dtype, tuple(vars(cluster).values()))
    return memoised(st, key, lambda: max(one(r) for r in ranks))
