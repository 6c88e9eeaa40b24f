"""The layouts `hpengine plan` ranks: every legal combination of degrees, schedules, micro-batch sizes,
recompute, amp and sequence parallelism of a model on a cluster (candidates), the helpers that generate each
axis's choices (shared with the branch and bound of planner/prune.py), and the ranking order (rank_key).
"""
from __future__ import annotations

from itertools import product

from hpengine.layout.degrees import AmpPolicy, BatchSplit, Degrees, PipelinePlan
from hpengine.layout.resolve import Resolved, expert_degrees as expert_degrees_of
from hpengine.layout.schedules import SCHEDULES
from hpengine.models import build_model, capabilities
from hpengine.planner.stages import stages


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_ok(m, tp: int) -> bool:
    return not build_model(m).tp_divides(tp)


def recompute_modes(m) -> list[tuple]:
    """(every, granularity) options: off, full, and selective where the model keeps attention probabilities."""
    scores = build_model(m).cache_bytes(1, 1, 1, False, 1)["scores"]
    return [(0, "full"), (1, "full")] + ([(1, "selective")] if scores else [])


def candidates(cfg, cluster, max_rows: int = 8):
    """Every legal layout (resolve.Resolved) on the cluster: degrees that multiply to the world, tp within a
    node and dividing heads and widths (with and without sequence parallelism), exact batch arithmetic,
    each schedule, recompute (full, selective), amp, context parallel degrees (context_degrees)."""
    m, W, gb = cfg.model, cluster.world, cfg.train.global_batch
    tps = [t for t in divisors(W) if t <= cluster.gpus_per_node and tp_ok(m, t)]
    modes, split_sends = recompute_modes(m), cfg.strategy.pipeline.scatter_gather
    comm = cfg.strategy.context_parallel.comm
    for tp, cp, pp in [(t, c, p) for t in tps for c in context_degrees(m, W // t)
                       for p in divisors(W // (t * c)) if p <= m.n_layers]:
        tensors = min(len(st.sizes(cfg.train.models)) for st in stages(m, tp, pp, 1))
        sps = (False, True) if tp > 1 and (m.seq_len // cp) % tp == 0 else (False,)
        rest = W // (tp * cp * pp)           # ranks for sharding x dp (the replicas)
        for sh in [s for s in divisors(rest) if gb % rest == 0]:
            dp, share = rest // sh, gb // rest
            rows = [r for r in divisors(share) if r <= max_rows]
            for zstage, b, (rc, gran), amp, sp in product([0] if sh == 1 else [1, 2, 3], rows, modes, ("", "float16"),
                                                          sps):
                if cp > 1 and gran == "selective":      # the cp drivers keep no probabilities to drop
                    continue
                n = share // b          # micro-batches: the pipeline's, else gradient-merge passes
                for (sched, v), ep in product(schedules(pp, n, m.n_layers), expert_degrees(m, dp, sh, cfg.optim.name)):
                    yield Resolved(Degrees(tp, cp, sh, dp, pp, ep, tuple(cfg.mesh.order)),
                                   PipelinePlan(n if pp > 1 else 1, v, sched, "uniform",
                                                tp > 1 and pp > 1 and not sp and split_sends),
                                   AmpPolicy(amp), BatchSplit(share, 1 if pp > 1 else n), zstage=zstage,
                                   partition="tensor" if sh <= tensors else "flat",
                                   bucket_mb=cfg.strategy.data_parallel.bucket_mb, recompute=rc, granularity=gran,
                                   sp=sp, cp_comm=comm, optimizer=cfg.optim.name,
                                   muon_ns_steps=cfg.optim.muon_ns_steps)


def context_degrees(m, ranks: int) -> list[int]:
    """Context-parallel degrees: divisors of the ranks left by tp whose 2 x degree divides model.seq_len;
    only 1 for the mlp kind (no attention) and MoE models (per-sequence balancing losses and capacity)."""
    caps = capabilities(m)
    if not caps.attention or caps.experts:
        return [1]
    return [c for c in divisors(ranks) if c == 1 or m.seq_len % (2 * c) == 0]


def expert_degrees(m, dp: int, sh: int = 1, optimizer: str = "adamw") -> list[int]:
    """Expert-parallel degrees of an MoE model: divisors of dp x sharding that divide the experts (layout/resolve.py's
    rule: one that divides dp has a sharding group shard one ep rank's experts; any other spans sharding ranks,
    each keeping its expert block whole, which an optimizer of whole tensors does not support)."""
    experts = capabilities(m).experts
    return expert_degrees_of(experts, dp, sh, optimizer) if experts else [1]


def schedules(pp: int, m: int, layers: int):
    """(schedule, chunks per stage) candidates for pp stages, m micro-batches and `layers` blocks to cut: those
    with fixed chunks first (registry order), then those that choose theirs (2 or 4); each where its rules hold."""
    if pp == 1:
        return [(next(iter(SCHEDULES)), 1)]
    fixed = [(s.name, s.chunks) for s in SCHEDULES.values() if s.chunks is not None]
    free = [(s.name, v) for s in SCHEDULES.values() if s.chunks is None for v in (2, 4)]
    return [(name, v) for name, v in fixed + free if (v == 1 or pp * v <= layers)
            and m >= SCHEDULES[name].min_micro_batches(pp)
            and (m % pp == 0 or not SCHEDULES[name].groups_of_p)]


def rank_key(r: dict) -> tuple:
    """Equal step times: the layout that needs less memory first, then the one that sends less."""
    return round(r["time"]["step"], 9), r["memory"]["total"], sent_bytes(r)


def sent_bytes(r: dict) -> int:
    """Bytes the worst stage's rank sends per step (ties in time and memory go to the layout that sends less)."""
    st = next(s for s in r["stages"] if s["stage"] == r["stage"])
    return sum(b for ops in st["traffic"].values() for op, b in ops.items() if op != "recv")
