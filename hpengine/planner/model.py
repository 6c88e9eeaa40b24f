"""The planner's model of one layout: its stages, what each rank sends (bytes per communicator and
operation) in one optimizer step, and an alpha-beta time model on a cluster; what it holds is memory.py's.
Byte counts come from the model's own ParamSpecs and the engine's partition and schedules, so they equal
what the engine allocates and its comm.py counters record.
"""
from __future__ import annotations

import functools
import math

from hpengine.layout.resolve import Resolved, resolve
from hpengine.layout.schedules import bubble_fraction, placement
from hpengine.models import build_model, capabilities
from hpengine.planner import context as plan_cp, gpu as plan_gpu, moe as plan_moe, muon as plan_muon, recompute as rc
from hpengine.planner import diloco as plan_diloco, tp as plan_tp
from hpengine.planner.memory import (_partition, _read_blocks, activations, block_activations, buffers, model_state,
                                     owned, owned_experts, packed_caches, precision)
from hpengine.planner.stages import StageFacts, memoised, micro_batch_key, stages

F64 = 8                  # the engine's loss and squared-norm vectors are float64, one entry per model
_bubble = functools.lru_cache(maxsize=4096)(bubble_fraction)     # the planner asks often; it builds a schedule


# ---- communication ---------------------------------------------------------------------------------

def gathered_per_microbatch(mcfg, st: StageFacts) -> int:
    """Elements stage 3 gathers per micro-batch and model: every block in forward and again in backward
    (except blocks whose backward reads no parameters, the embedding); a block gathers the blocks whose
    tensors it reads with it both times (a tied head: the embedding)."""
    return memoised(st, ("gathered",), lambda: _gathered(st))


def _gathered(st: StageFacts) -> int:
    total, bwd = 0, {b.name: b.bwd_params for b in st.kinds}
    for chunk in st.chunks:
        total += sum((1 + bwd[b]) * st.block(b) for b in chunk)
        total += 2 * sum(st.block(d) for d in _read_blocks(st, chunk))
    return total


def wire_item(lay: Resolved, item: int, packed: bool) -> int:
    """Bytes an element of the activations and gradients between pipeline stages takes: packed bf16 storage
    sends their bfloat16 bits."""
    return 2 if packed and lay.amp == "bfloat16" else item


def traffic(mcfg, st: StageFacts, lay: Resolved, stage: int, models: int, sh_rank=None, packed: bool = False,
            replica=None) -> dict:
    """{axis: {op: bytes}} one rank sends in one optimizer step, as comm.py counts it (every rank
    counts its own buffer of a collective; "tied" is the first/last-stage wte gradient sum); packed
    (packed_caches): the parameters' all-gathers and the pipeline's sends move bfloat16 bits. replica: the
    rank's place among dp x cp (what Muon's updates moved over sharding depend on; None: the busiest)."""
    w, g, _, item = precision(mcfg, lay.amp, packed)
    M, psi, out = models, st.psi * models, {}
    mtp = M if capabilities(mcfg).mtp_depth else 0      # each model's multi-token prediction loss
    losses = F64 * (M + mtp + plan_moe.loss_figures(mcfg, M))   # the loss allreduce, with the MoE figures riding on it
    whole = st.experts * M if lay.experts_whole else 0     # ep across sharding: expert blocks kept whole
    if lay.sh > 1:
        gathers = psi * w if lay.zstage < 3 else lay.k * lay.m * M * gathered_per_microbatch(mcfg, st) * w
        out["sharding"] = {"reduce": (psi - whole) * g, "allgather": gathers, "allreduce": F64 * M + losses}
    if lay.dp * lay.cp > 1:            # expert blocks split over ep: summed over their replicas only
        experts = owned_experts(st, lay, M, sh_rank)
        out[lay.grad_group] = {"allreduce": (owned(st, lay, M, sh_rank) - experts) * g + losses}
        if lay.dp // lay.ep > 1 and experts and not whole:
            out["ep-dp"] = {"allreduce": experts * g}
    if whole and lay.dp * lay.sh * lay.cp // lay.ep > 1:   # each block summed over the ranks that hold it
        out["ep-dp"] = {"allreduce": whole * g}
    if plan_muon.runs(lay):     # each Newton-Schulz owner's results, shared over the replicas (in the masters' dtype)
        dense, expert = plan_muon.owned_elements(st, lay, M, sh_rank)
        master = 4 if lay.amp else item
        if lay.dp * lay.cp > 1 and dense:
            out[lay.grad_group]["allgather"] = dense * master
        if lay.dp // lay.ep > 1 and expert:
            out["ep-dp"]["allgather"] = expert * master
        moved, calls = plan_muon.hop_elements(st, lay, M, sh_rank, replica)
        if calls:       # the updates to their Newton-Schulz owners over sharding, the results back
            out["sharding"]["alltoallv"] = moved * master
    if lay.ep > 1:
        out["ep"] = {"allreduce": F64 * M, "alltoallv": plan_moe.alltoall_bytes(mcfg, st, lay, item)}
    if lay.cp > 1:          # the ring's (or all-gather's) k, v on the cp communicator, beside the gradient sum
        out.setdefault("cp", {}).update(plan_cp.traffic(mcfg, st, lay, item, M))
    tokens = lay.share * mcfg.seq_len // lay.cp * M
    if lay.tp > 1:
        rep = plan_tp.replicated_owned(st, lay, M, _partition, sh_rank)
        out["tp"] = plan_tp.traffic(mcfg, st, lay, tokens, item, g, 4 if lay.amp else item, F64 * M, rep,
                                    packed and lay.amp == "bfloat16")
    hops = _hops(lay, stage)
    if hops:                 # activations to the next virtual stage, gradients to the previous one
        act, gathered = plan_tp.pipeline_bytes(mcfg, lay, tokens, wire_item(lay, item, packed), hops)
        out["pp"] = {"send": act, "recv": act}
        if gathered:
            out["tp"]["allgather"] = out["tp"].get("allgather", 0) + gathered
    if lay.pp > 1:
        out["pp"]["allreduce"] = F64 * M + losses
        if st.tied:
            out["tied"] = {"allreduce": M * st.tied * g}
    return out


def _hops(lay: Resolved, stage: int) -> int:
    """Sends per micro-batch of one rank: forward out of every chunk but the last virtual stage,
    backward out of every chunk but the first, except to a chunk on this rank (zbv's turn on the last
    rank, handed over in memory). ZB-V crosses 2p - 2 links per micro-batch each way, 1F1B p - 1."""
    return _hops_of(lay.schedule, lay.pp, lay.v, stage)


@functools.lru_cache(maxsize=65536)
def _hops_of(schedule: str, pp: int, v: int, stage: int) -> int:
    V, place = pp * v, placement(schedule, pp, v)
    out = 0
    for c in range(v):
        g = place.virtual(stage, c)
        out += (g < V - 1 and place.stage_of(g + 1) != stage) + (g > 0 and place.stage_of(g - 1) != stage)
    return out


def stage_facts(cfg, lay: Resolved, docs=None) -> list[StageFacts]:
    """The layout's stages; docs: the plan's DocumentFacts (None: one document a row)."""
    return stages(cfg.model, lay.tp, lay.pp, lay.v, lay.split, lay.schedule, lay.ep, _attention(docs))


def _attention(docs) -> float:
    return 1.0 if docs is None else docs.attention


# ---- time ------------------------------------------------------------------------------------------

def axis_span(lay: Resolved, axis: str) -> int:
    """Consecutive ranks one group of a mesh axis spreads over: its degree times those of the axes inside it."""
    deg = _degrees(lay)
    return math.prod(deg[a] for a in lay.order[:lay.order.index(axis)]) * deg[axis]


def link(lay: Resolved, axis: str, cluster, op: str = "allreduce") -> tuple:
    """(latency s, bandwidth B/s) of an operation on a mesh axis: intra-node when its ranks, spaced by
    the degrees of the axes inside it (mesh order, innermost first), fall in one node; between sites
    (cluster.site_nodes) when they cross the slow link; a reduce or an allgather at its own measured
    bandwidth where the cluster gives one (between nodes, at most that)."""
    span, gpn = axis_span(lay, axis), cluster.gpus_per_node
    own = {"reduce": cluster.reduce_bw_gbs, "allgather": cluster.allgather_bw_gbs}.get(op, 0.0) * 1e9
    if span <= gpn and gpn % span == 0:
        return cluster.intra_latency_us * 1e-6, own or cluster.intra_bw_gbs * 1e9
    if cluster.spans_sites(span):
        rate, latency, _ = cluster.site_link()
        return latency, min(own or math.inf, rate)
    return cluster.inter_latency_us * 1e-6, min(own or math.inf, cluster.inter_bw_gbs * 1e9)


def collective_s(op: str, n: int, nbytes: float, calls: float, alpha: float, beta: float) -> float:
    """Alpha-beta cost: the bytes a ring moves (allreduce 2(n-1)/n, reduce and allgather (n-1)/n,
    send/recv all of them) and ceil(log2 n) latencies per call (recursive doubling or a binomial
    tree, what MPI uses for the small messages where latency matters; one per send)."""
    if op in ("send", "recv"):
        return nbytes / beta + calls * alpha
    if n <= 1:
        return 0.0
    share = 2 * (n - 1) / n if op == "allreduce" else (n - 1) / n
    return share * nbytes / beta + calls * math.ceil(math.log2(n)) * alpha


def matmul_flops(mcfg, tokens: int, weights: int, layers: int, tp: int, f: int = 6, attention: float = 1.0) -> float:
    """f·N·tokens over N weights (f = 6 forward and backward), plus the attention scores and their
    product with the values, f/2 times their forward, of which packed documents leave `attention`
    (StageFacts.attention)."""
    return f * tokens * weights + f // 2 * attention_flops(mcfg, tokens, tp, attention) * layers


def attention_flops(mcfg, tokens: int, tp: int, attention: float = 1.0) -> float:
    """Forward FLOPs of one layer's scores and their product with the values on one tp rank: the model's own
    figure, times the share packed documents leave (planner/documents.py)."""
    dense = build_model(mcfg, tp).attention_flops(tokens, tp)
    return dense if attention == 1.0 else dense * attention


def flops_per_microbatch(mcfg, st: StageFacts, lay: Resolved) -> float:
    """6·N·tokens over the weights this rank multiplies by, plus attention scores, plus what the
    recomputed layers rebuild (planner/recompute.py: extra_flops)."""
    tokens = lay.rows * mcfg.seq_len // lay.cp
    return (matmul_flops(mcfg, tokens, st.matmul, st.layers, lay.tp, attention=st.attention)
            + rc.extra_flops(mcfg, st, lay, tokens))


def _device_flops(mcfg, lay: Resolved, cluster) -> float:
    if lay.amp:
        return cluster.tflops * 1e12
    return (cluster.tflops_fp64 if mcfg.dtype == "float64" else cluster.tflops_fp32) * 1e12


def oversubscription(lay: Resolved, cluster) -> float:
    """How many of a node's ranks share each CPU core (>= 1): with more ranks on a node than cores
    (cluster.cores_per_node; 0 = a core per device), each computes at that fraction of its rate."""
    cores = cluster.cores_per_node
    ranks = min(lay.world, cluster.gpus_per_node)
    return max(1.0, ranks / cores) if cores else 1.0


def compute_s(mcfg, st: StageFacts, lay: Resolved, cluster) -> float:
    """_compute_s, memoised on the stage by what it reads (stages.micro_batch_key)."""
    return memoised(st, ("compute", micro_batch_key(lay), tuple(vars(cluster).values())),
                    lambda: _compute_s(mcfg, st, lay, cluster))


def _compute_s(mcfg, st: StageFacts, lay: Resolved, cluster) -> float:
    """Seconds of one micro-batch of one model through the stage on one device (or core): its matmul
    FLOPs at the sustained rate (GPU clusters with gemm_half_dim, mem_bw_gbs or launch_us: each GEMM at
    its shape's rate and the cached bytes' element-wise passes at the memory bandwidth, planner/gpu.py); on
    CPUs (calibrated block_us, act_ns) also a fixed overhead per block pass (forward, backward, and a
    recomputed block's second forward) and the elementwise passes (layernorm, softmax, GELU, residuals)
    over the activations the forward caches, by their bytes (a second forward: about half of its layer's
    again; a selective rebuild: the probabilities). Under expert parallelism the routed experts' GEMMs take
    cluster.moe_imbalance times their balanced share (the rank holding the most-loaded expert: everyone
    waits for it at the all-to-all)."""
    item = precision(mcfg, lay.amp)[3]
    again = len(rc.full(st, lay))
    a = block_activations(mcfg, lay, item)
    cached = sum(a[b.kind] for b in st.kinds) + rc.elementwise_bytes(a, st, lay)
    peak = _device_flops(mcfg, lay, cluster)
    work = (plan_gpu.compute_s(mcfg, st, lay, cluster, peak, item, cached) if plan_gpu.enabled(cluster)
            else flops_per_microbatch(mcfg, st, lay) / peak)
    if lay.ep > 1:          # the rank of the most-loaded expert does imbalance x its balanced expert GEMMs
        work += (cluster.moe_imbalance - 1) * 6 * lay.rows * mcfg.seq_len // lay.cp * st.expert_mm / peak
    return work + (2 * len(st.names) + again) * cluster.block_us * 1e-6 + cached / 4 * cluster.act_ns * 1e-9


# The parts of a micro-batch's critical path (stage_times); planner/bound.py calls them too, with links no
# better than the layout's, so its floor under a family of layouts is this very arithmetic.

def _compute_total(mcfg, st: StageFacts, lay: Resolved, models: int, cluster) -> float:
    return oversubscription(lay, cluster) * models * compute_s(mcfg, st, lay, cluster)


def _split_gathered(mcfg, lay: Resolved, stage: int, models: int, cluster) -> int:
    """Bytes per step the receiving stage all-gathers over tp of sends split across tp."""
    return plan_tp.pipeline_bytes(mcfg, lay, lay.share * mcfg.seq_len // lay.cp * models,
                                  wire_item(lay, precision(mcfg, lay.amp)[3], packed_caches(lay, cluster)),
                                  _hops(lay, stage))[1]


def _tp_s(mcfg, st: StageFacts, lay: Resolved, models: int, tp_bytes: dict, gathered: int, tp_link) -> float:
    mb = lay.k * lay.m
    per_mb = {op: (n - (gathered if op == "allgather" else 0)) / mb for op, n in tp_bytes.items()}
    return plan_tp.tp_seconds(mcfg, st, lay, models, {op: n for op, n in per_mb.items() if n}, tp_link, collective_s)


def _pp_s(mcfg, st: StageFacts, lay: Resolved, stage: int, models: int, cluster, link_of) -> float:
    mb, hops = lay.k * lay.m, _hops(lay, stage)
    packed = packed_caches(lay, cluster)
    act, gathered = plan_tp.pipeline_bytes(mcfg, lay, lay.share * mcfg.seq_len // lay.cp * models,
                                           wire_item(lay, precision(mcfg, lay.amp, packed)[3], packed), hops)
    return (collective_s("send", 2, act / mb, hops * models, *link_of(lay, "pp", cluster))
            + plan_tp.pipeline_gather_seconds(lay, gathered / mb, hops, models,
                                              lambda op: link_of(lay, "tp", cluster, op), collective_s))


def _cp_s(mcfg, st: StageFacts, lay: Resolved, models: int, comp: float, cluster, link_of) -> float:
    return plan_cp.ring_seconds(mcfg, st, lay, precision(mcfg, lay.amp)[3], models, comp / models,
                                *link_of(lay, "cp", cluster))


# small allreduces a step makes on each axis: squared gradient norms (sharding, pp, tp), losses (sharding, dp, pp)
SCALAR_CALLS = {"sharding": 2, "dp": 1, "pp": 2, "tp": 1}


def _degrees(lay: Resolved) -> dict:
    return lay.degrees.by_axis


def stage_times(mcfg, st: StageFacts, lay: Resolved, stage: int, models: int, cluster, sh_rank=None, tr=None) -> dict:
    """Seconds per micro-batch (compute, tp, pp: on the critical path) and per step (dp, sharding:
    exposed after overlapping the last backward / the forward prefetch; fixed: the optimizer over the
    owned elements (Muon: and its Newton-Schulz GEMMs, planner/muon.py), the scalar allreduces and the per-step overhead). "hidden": {what: (seconds hidden behind
    compute, bytes per step)} for the gradient and sharding collectives that overlap compute. tr: traffic() of
    the largest sharding share, when the caller has it."""
    tr, M = tr or traffic(mcfg, st, lay, stage, models, packed=packed_caches(lay, cluster)), models
    slow = oversubscription(lay, cluster)
    comp = _compute_total(mcfg, st, lay, M, cluster)
    mb = lay.k * lay.m
    own = owned(st, lay, M, sh_rank) if lay.zstage else st.psi * M
    K = precision(mcfg, lay.amp, optimizer=lay.optimizer)[2]   # optimizer_ns is measured in float32 (K = 8 bytes)
    opt = cluster.optimizer_ns * 1e-9 * own * K / 8
    if plan_muon.runs(lay):     # and the Newton-Schulz GEMMs, on the owner with the most of both
        opt = plan_muon.optimizer_seconds(mcfg, st, lay, M, cluster, K, sh_rank)
    fixed = slow * (opt + cluster.step_overhead_us * 1e-6)
    deg = _degrees(lay)
    fixed += sum(collective_s("allreduce", deg[a], 0, c, *link(lay, a, cluster)) for a, c in SCALAR_CALLS.items())
    out = {"compute": comp, "tp": 0.0, "pp": 0.0, "ep": 0.0, "cp": 0.0, "dp": 0.0, "sharding": 0.0, "fixed": fixed,
           "hidden": {}}
    if lay.cp > 1:          # the ring's transfers past the block compute they overlap, on the cp axis's link
        out["cp"] = _cp_s(mcfg, st, lay, M, comp, cluster, link)
    gathered = _split_gathered(mcfg, lay, stage, M, cluster)
    if "tp" in tr:          # the tp regions' collectives; a split pipeline send's gather counts with pp
        out["tp"] = _tp_s(mcfg, st, lay, M, tr["tp"], gathered, lambda op: link(lay, "tp", cluster, op))
    if "pp" in tr:
        out["pp"] = _pp_s(mcfg, st, lay, stage, M, cluster, link)
    if "ep" in tr:          # an ep group is consecutive dp ranks: the dp link
        out["ep"] = plan_moe.alltoall_seconds(lay, cluster.moe_imbalance * tr["ep"]["alltoallv"] / mb,
                                              plan_moe.alltoall_calls(mcfg, st, lay) / mb, *link(lay, "dp", cluster))
    hide = cluster.overlap * comp           # what may hide gradient sync: the last backward, 2/3 of a micro-batch
    grad = lay.grad_group if lay.cp > 1 else "dp"      # gradients summed over dp x cp under context parallelism
    if lay.dp * lay.cp > 1 and grad in tr:
        a, b = link(lay, "dp" if lay.dp > 1 else "cp", cluster)
        calls = 1 if lay.sh > 1 else max(1, math.ceil(tr[grad]["allreduce"] / (lay.bucket_mb * 2**20)))
        t = collective_s("allreduce", lay.dp * lay.cp, tr[grad]["allreduce"], calls, a, b)
        if "ep-dp" in tr:   # the expert blocks' replicas: every ep-th dp rank, on the same link
            t += collective_s("allreduce", lay.dp // lay.ep, tr["ep-dp"]["allreduce"], calls, a, b)
        out["dp"] = t if lay.sh > 1 else max(0.0, t - 2 / 3 * hide)
        out["hidden"]["dp allreduce"] = (t - out["dp"], tr[grad]["allreduce"] + tr.get("ep-dp", {}).get("allreduce", 0))
    if "sharding" in tr:
        parts = len(st.names) * M + lay.sh - 1          # a reduce per (block, owner) piece
        red = collective_s("reduce", lay.sh, tr["sharding"]["reduce"], parts,
                           *link(lay, "sharding", cluster, "reduce"))
        if lay.experts_whole and "ep-dp" in tr:     # the whole expert blocks' sums, one per MoE block, beside it
            red += collective_s("allreduce", lay.dp * lay.sh // lay.ep, tr["ep-dp"]["allreduce"],
                                sum(st.expert) * M,
                                *link(lay, "dp" if lay.dp > 1 else "sharding", cluster))
        # stage 3 gathers each block from its owner, twice a micro-batch; stages 1-2 share every range once
        gathers = mb * M * sum(1 + b.bwd_params for b in st.kinds) if lay.zstage == 3 else 1
        gat = collective_s("allgather", lay.sh, tr["sharding"]["allgather"], gathers,
                           *link(lay, "sharding", cluster, "allgather" if lay.zstage == 3 else "allreduce"))
        prefetch = mb * hide / 3 if lay.zstage == 3 else 0.0
        out["sharding"] = max(0.0, red - 2 / 3 * hide) + max(0.0, gat - prefetch)
        if "alltoallv" in tr["sharding"]:      # Muon's updates to their Newton-Schulz owners and back
            a, b = link(lay, "sharding", cluster)
            out["sharding"] += collective_s("send", lay.sh, tr["sharding"]["alltoallv"], 2 * M, a, b)
        out["hidden"]["sharding reduce"] = (red - max(0.0, red - 2 / 3 * hide), tr["sharding"]["reduce"])
        out["hidden"]["sharding all-gather"] = (gat - max(0.0, gat - prefetch), tr["sharding"]["allgather"])
    return out


def predict_stage(mcfg, st: StageFacts, lay: Resolved, stage: int, models: int, cluster=None, sh_rank=None,
                  replica=None) -> dict:
    """Memory (bytes) and traffic of one rank of `stage` (at sharding rank `sh_rank` and place `replica` among
    dp x cp; None: the largest share); times when a cluster is given."""
    item, packed = precision(mcfg, lay.amp)[3], packed_caches(lay, cluster)
    mem = model_state(mcfg, st, lay, models, sh_rank, packed)
    mem["activations"] = activations(mcfg, st, lay, stage, item, packed)
    mem["buffers"] = buffers(mcfg, st, lay, owned(st, lay, models, sh_rank), packed)
    mem["total"] = sum(mem.values())
    out = {"stage": stage, "memory": mem, "traffic": traffic(mcfg, st, lay, stage, models, sh_rank, packed, replica)}
    if cluster is not None:         # its times read the largest share's traffic, whatever sh_rank
        out["times"] = stage_times(mcfg, st, lay, stage, models, cluster, sh_rank,
                                   out["traffic"] if sh_rank is None else None)
    return out


def step_time(per_stage: list[dict], lay: Resolved) -> dict:
    """Combine stages: the slowest micro-batch sets the pipeline's pace (plus the schedule's bubble),
    then the slowest stage's exposed gradient sync and parameter sharing. With more ranks than cores,
    a rank waiting in the bubble still takes its share of a core (MPI waits by polling), so the
    bubble, like the compute, runs at the oversubscribed pace."""
    slow = max(per_stage, key=lambda s: s["times"]["compute"] + s["times"]["tp"] + s["times"]["pp"]
               + s["times"].get("ep", 0.0) + s["times"].get("cp", 0.0))["times"]
    ep = slow.get("ep", 0.0)            # expert parallel's all-to-alls (none without experts split)
    cp = slow.get("cp", 0.0)            # context parallel's exposed ring transfers
    t_mb = slow["compute"] + slow["tp"] + slow["pp"] + ep + cp
    f = _bubble(lay.schedule, lay.pp, lay.m, lay.v) if lay.pp > 1 else 0.0
    per_pass = lay.m * t_mb / (1 - f)
    sync = max(per_stage, key=lambda s: s["times"]["dp"] + s["times"]["sharding"] + s["times"]["fixed"])["times"]
    n = lay.k * lay.m
    out = {"compute": n * slow["compute"], "tp": n * slow["tp"], "pp": n * slow["pp"], "ep": n * ep, "cp": n * cp,
           "dp": sync["dp"],
           "sharding": sync["sharding"], "fixed": sync["fixed"], "bubble": lay.k * (per_pass - lay.m * t_mb),
           "hidden": sync.get("hidden", {})}
    out["step"] = lay.k * per_pass + sync["dp"] + sync["sharding"] + sync["fixed"]
    return out


def for_rank(cfg, world: int, coords: dict, cluster=None) -> dict:
    """The prediction for the rank at mesh `coords` (its pipeline stage and sharding share)."""
    lay = resolve(cfg, world)
    st = stage_facts(cfg, lay)[coords["pp"]]
    out = predict_stage(cfg.model, st, lay, coords["pp"], cfg.train.models, cluster, coords["sharding"],
                        replica_index(lay, coords))
    if lay.islands > 1:
        item = 4 if lay.amp else precision(cfg.model, lay.amp)[3]
        M = cfg.train.models
        own = owned_range(st, lay, M, coords["sharding"])
        _add_replica(out["traffic"], cfg, lay, own, st.sizes(M), item, boxes(st, lay, M, coords["tp"]),
                     coords.get("replica", 0))
        _add_outer(out["memory"], cfg.strategy.diloco, own, item)
    return out


def _add_outer(mem: dict, dl, own: tuple, item: int) -> None:
    """DiLoCo's outer state (its owned part, in the optimizer's dtype) into a rank's memory."""
    total = mem.pop("total")
    mem["outer"] = plan_diloco.state_bytes(dl, own[1] - own[0], item)
    mem["total"] = total + mem["outer"]


def _add_replica(traffic: dict, cfg, lay: Resolved, own: tuple, sizes, item: int, held, island: int) -> None:
    """DiLoCo's bytes per step into a stage's traffic: the exchange on `replica`, the outer metrics' norms, the
    int8/int4 scales' MAX inside the island (held: boxes(); island: the rank's, whose chunk it re-quantises)."""
    dl = cfg.strategy.diloco
    traffic["replica"] = plan_diloco.traffic(dl, lay.islands, own, sizes, item, held)
    for part in (plan_diloco.norm_traffic(dl, lay, cfg.train.models),
                 plan_diloco.block_max_traffic(dl, lay, island, own, sizes, held)):
        for axis, ops in part.items():
            for op, b in ops.items():
                traffic.setdefault(axis, {})[op] = traffic.get(axis, {}).get(op, 0) + b


def boxes(st: StageFacts, lay: Resolved, models: int, tp_rank: int = 0) -> tuple:
    """(spec, the global slices a tp rank holds) of each tensor of the stage, sizes' order (DiLoCo's blocks)."""
    return tuple((sp, sp.tp_slices(tp_rank, lay.tp, 0, lay.ep)) for _ in range(models) for sp in st.specs)


def replica_index(lay: Resolved, coords: dict) -> int:
    """The rank's place in its dp x cp communicator (dist/topology.py: innermost axis fastest)."""
    at, stride = 0, 1
    for a in lay.order:
        if a in lay.grad_axes:
            at += coords[a] * stride
            stride *= {"dp": lay.dp, "cp": lay.cp}[a]
    return at


def predict_layout(cfg, lay: Resolved, cluster, stage_ids=None, sts=None, docs=None) -> dict:
    """Prediction for a layout: per-stage results, the worst stage's memory, the step time. sts: its stages
    (stages.stages of the layout's cut), when the caller has them; docs: the plan's DocumentFacts (their
    attention share, when sts is not given)."""
    sts = sts or stage_facts(cfg, lay, docs)
    ids = range(lay.pp) if stage_ids is None else sorted({s for s in stage_ids if 0 <= s < lay.pp})
    per = [predict_stage(cfg.model, sts[s], lay, s, cfg.train.models, cluster) for s in ids]
    worst = max(per, key=lambda r: r["memory"]["total"])
    out = {"layout": lay, "stages": per, "memory": worst["memory"], "stage": worst["stage"]}
    if cluster is not None:
        out["time"] = step_time(per, lay)
        out["tokens_per_s"] = cfg.train.global_batch * cfg.model.seq_len * cfg.train.models / out["time"]["step"]
    if lay.islands > 1:
        _replica(cfg, lay, sts, per, out, cluster)
    return out


def _replica(cfg, lay: Resolved, sts, per: list, out: dict, cluster) -> None:
    """DiLoCo: each stage's replica traffic per step and outer state (the worst stage's memory chosen again); with a
    cluster, out["replica"]: the islands' link (the one between sites when they span sites and
    runtime.replica_link is unset) and the slowest stage's time on it per step (outside the step time: the exchange
    runs between inner steps)."""
    dl = cfg.strategy.diloco
    item = 4 if lay.amp else precision(cfg.model, lay.amp)[3]      # what the optimizer updates: the masters
    M = cfg.train.models
    own = {r["stage"]: (owned_range(sts[r["stage"]], lay, M), sts[r["stage"]].sizes(M), boxes(sts[r["stage"]], lay, M))
           for r in per}
    for r in per:      # the last island's chunk: the largest when the blocks do not divide evenly
        o, sz, held = own[r["stage"]]
        _add_replica(r["traffic"], cfg, lay, o, sz, item, held, lay.islands - 1)
        _add_outer(r["memory"], dl, own[r["stage"]][0], item)
    worst = max(per, key=lambda r: r["memory"]["total"])
    out["memory"], out["stage"] = worst["memory"], worst["stage"]
    if cluster is not None:
        rate, latency, name = plan_diloco.link_of(cfg.runtime, cluster)
        if not cfg.runtime.replica_link and cluster.spans_sites(lay.world):   # islands that meet across sites
            rate, latency, name = cluster.site_link()
        secs = max(plan_diloco.seconds_per_step(dl, lay.islands, o, sz, item, b, rate, latency)
                   for o, sz, b in own.values())
        out["replica"] = {"link": name, "seconds_per_step": secs}


def owned_range(st: StageFacts, lay: Resolved, models: int, sh_rank=None) -> tuple[int, int]:
    """(start, stop) of the stage's flat range a sharding rank owns (the largest share when sh_rank is None;
    expert blocks kept whole across sharding: its element count from 0)."""
    sizes = st.sizes(models)
    if lay.sh == 1:
        return 0, sum(sizes)
    if lay.experts_whole:
        return 0, owned(st, lay, models, sh_rank)
    ranges = _partition(sizes, lay.sh, lay.partition)
    r = max(ranges, key=lambda r: r.size) if sh_rank is None else ranges[sh_rank]
    return r.start, r.stop
