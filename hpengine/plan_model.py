"""The planner's model of one layout: what each rank holds (ZeRO model states, activation caches,
transient buffers) and sends (bytes per communicator and operation) in one optimizer step, and an
alpha-beta time model on a cluster. Byte counts come from the model's own ParamSpecs and the engine's
partition and schedules, so they equal what the engine allocates and its comm.py counters record.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from .buffers import partition
from .models import build_model
from .nn import attention as _attention
from .strategies.pipeline import split_blocks
from .strategies.schedules import bubble_fraction, make_schedule
from .strategies.sharding import MAX_INFLIGHT
from .topology import AXES, SWITCH_OF_AXIS, resolve_degrees

F64 = 8                  # the engine's loss and squared-norm vectors are float64, one entry per model
INT_BYTES = 8 + 1        # an int64 index and a bool mask per token (embedding; vocab-parallel loss)


@dataclass(frozen=True)
class Layout:
    """The switches and degrees of one job, resolved for a world size."""
    tp: int
    sh: int
    dp: int
    pp: int
    zstage: int            # sharding stage, 0 when the sharding axis has one rank
    partition: str
    m: int                 # micro-batches per pass
    k: int                 # passes per step (gradient merge)
    v: int                 # model chunks per pipeline rank
    schedule: str
    split: object
    recompute: int         # 0 = off, else every N-th block
    amp: bool
    order: tuple
    share: int             # sequences per replica per step
    bucket_mb: float = 4.0

    @property
    def rows(self) -> int:
        """Sequences per micro-batch."""
        return self.share // (self.k * self.m)


def layout_of(cfg, world: int) -> Layout:
    """The Layout the engine would build for cfg on `world` ranks (degrees as topology resolves them)."""
    s = cfg.strategy
    d = resolve_degrees(world, {a: (getattr(s, SWITCH_OF_AXIS[a]).degree if getattr(s, SWITCH_OF_AXIS[a]).enable
                                    else 1) for a in AXES})
    pc, gm, rc = s.pipeline, s.gradient_merge, s.recompute
    k = gm.k_steps if gm.enable else 1
    m = pc.micro_batches if pc.enable else 1
    return Layout(d["tp"], d["sharding"], d["dp"], d["pp"], s.sharding.stage if d["sharding"] > 1 else 0,
                  s.sharding.partition, m, k, pc.virtual_stages if pc.enable else 1,
                  pc.schedule if pc.enable else "fthenb", pc.split if pc.enable else "uniform",
                  rc.every if rc.enable else 0, s.amp.enable, tuple(cfg.mesh.order),
                  cfg.train.global_batch // (d["dp"] * d["sharding"]), s.data_parallel.bucket_mb)


# ---- what a pipeline stage holds -------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    """One pipeline stage of one model, per tp rank: its blocks in layout order with their element
    counts (the last stage's head includes the copy of a tied wte), its chunks, and shape facts."""
    blocks: tuple          # ((name, [tensor elements, ...]), ...)
    chunks: tuple          # block names per local chunk
    layers: int
    matmul: int            # elements of the weights this stage multiplies by (per tp rank)

    def sizes(self, models: int) -> list[int]:
        """Tensor element counts in layout order, for `models` models sharing the buffer."""
        return [n for _ in range(models) for _, sz in self.blocks for n in sz]

    def block(self, name: str) -> int:
        return sum(dict(self.blocks)[name])

    @property
    def psi(self) -> int:
        return sum(sum(sz) for _, sz in self.blocks)

    @property
    def names(self) -> list[str]:
        return [b for b, _ in self.blocks]


def stages(mcfg, tp: int, p: int, v: int, split="uniform") -> list[Stage]:
    """Every pipeline stage of the model, cut as the engine cuts it."""
    key = tuple(split) if isinstance(split, list) else split
    return _stages(dataclasses.astuple(mcfg), tp, p, v, key)


@functools.lru_cache(maxsize=4096)
def _stages(mkey, tp, p, v, split) -> list[Stage]:
    from .config import ModelConfig
    model = build_model(ModelConfig(*mkey), tp)
    count = lambda b: sum(math.prod(sp.global_shape) for sp in model.specs(b))  # noqa: E731
    chunks = split_blocks(model, p, v, list(split) if isinstance(split, tuple) else split, count)
    out = []
    for s in range(p):
        here = tuple(tuple(chunks[c * p + s]) for c in range(v))
        mine = [b for ch in here for b in ch]
        blocks, matmul = [], 0
        for b in mine:
            specs = model.specs(b)
            if b == "head" and model.tied:
                wte = model.specs("embed")[0]
                matmul += math.prod(wte.local_shape(0, tp))      # the tied head multiplies by wte
                specs = specs if "embed" in mine else [wte] + specs
            sizes = [math.prod(sp.local_shape(0, tp)) for sp in specs]
            matmul += sum(n for sp, n in zip(specs, sizes) if len(sp.global_shape) == 2 and b != "embed"
                          and not (b == "head" and sp.name == "wte"))
            blocks.append((b, tuple(sizes)))
        out.append(Stage(tuple(blocks), here, sum(b.startswith("h.") for b in mine), matmul))
    return out


# ---- memory ----------------------------------------------------------------------------------------

def zero_bytes(psi: float, share: float, stage: int, w: int, g: int, k: int) -> tuple:
    """ZeRO (Rajbhandari et al. 2020) model states of a rank owning `share` of `psi` elements:
    (parameters, gradients, optimizer) with w, g, k bytes per element; stage 0 = not sharded."""
    return (w * (share if stage >= 3 else psi), g * (share if stage >= 2 else psi),
            k * (share if stage >= 1 else psi))


def precision(mcfg, amp: bool) -> tuple:
    """(w, g, K, compute bytes): 16-bit copies and fp32 master + Adam under amp (K = 12), else the
    dtype for parameters and gradients and two Adam moments (K = 8 in float32)."""
    if amp:
        return 2, 2, 12, 2
    item = 8 if mcfg.dtype == "float64" else 4
    return item, item, 2 * item, item


def owned(st: Stage, lay: Layout, models: int, sh_rank=None) -> int:
    """Elements this sharding rank owns (the largest share when sh_rank is None)."""
    if lay.sh == 1:
        return st.psi * models
    ranges = _partition(tuple(st.sizes(models)), lay.sh, lay.partition)
    return max(r.size for r in ranges) if sh_rank is None else ranges[sh_rank].size


@functools.lru_cache(maxsize=4096)
def _partition(sizes, n, mode):
    return partition(list(sizes), n, mode)


def model_state(mcfg, st: Stage, lay: Layout, models: int, sh_rank=None) -> dict:
    w, g, k, _ = precision(mcfg, lay.amp)
    p, gr, o = zero_bytes(st.psi * models, owned(st, lay, models, sh_rank), lay.zstage, w, g, k)
    return {"params": p, "grads": gr, "optimizer": o}


def _score_elements(T: int) -> int:
    """Attention probabilities kept per (sequence, head): nn/attention.py splits the query rows into
    blocks that each see only the keys up to their end, so the fully masked corner is never stored."""
    blocks = getattr(_attention, "_blocks", lambda n: [(0, n)])(T)
    return sum((b - a) * b for a, b in blocks)


def block_activations(mcfg, lay: Layout, item: int) -> dict:
    """Bytes the engine's forward caches hold per block for one micro-batch (what Engine.cache_peak
    counts; see nn/): a gpt layer keeps 4 (B,T,C) arrays, 2 rstd rows, qkv, q and y (5 C/tp), the fc
    output and GELU factor (2 F/tp; the GELU output is rebuilt) and the attention probabilities."""
    T, C, F, rows = mcfg.seq_len, mcfg.d_model, mcfg.ffn_mult * mcfg.d_model, lay.rows
    bT, tp, Vp = rows * T, lay.tp, -(-mcfg.vocab_size // lay.tp) * lay.tp
    if mcfg.kind == "gpt":
        layer = bT * (4 * C + 2 + (5 * C + 2 * F) // tp) + rows * (mcfg.n_heads // tp) * _score_elements(T)
    else:
        layer = bT * (2 * C + 1 + 2 * F // tp)
    # the loss keeps float32 probabilities under amp; without tp it references the pass's int64 targets
    targets = bT * INT_BYTES if tp > 1 else lay.share * T * 8
    head = bT * (2 * C + 1) * item + bT * (Vp // tp) * (4 if lay.amp else item) + targets
    return {"embed": bT * INT_BYTES, "layer": layer * item, "input": bT * C * item, "head": head}


def recomputed(lay: Layout, block: str) -> bool:
    return bool(lay.recompute) and block.startswith("h.") and int(block[2:]) % lay.recompute == 0


def chunk_activations(mcfg, st: Stage, chunk, lay: Layout, item: int) -> int:
    """Cached bytes of one micro-batch through one chunk: a recomputed layer keeps only its input.
    Caches hold no weights (backward is handed them), so stage 3 frees gathered blocks after use."""
    a = block_activations(mcfg, lay, item)
    return sum(a["input" if recomputed(lay, b) else b if b in ("embed", "head") else "layer"] for b in chunk)


def activations(mcfg, st: Stage, lay: Layout, stage: int, item: int) -> int:
    """Peak cached bytes on this stage: the schedule's live (micro-batch, chunk) caches, weighted by
    chunk (F-then-B holds m, 1F1B min(p - s, m), interleaved per Megatron 2021). Several models run
    their passes one after another, so one model's caches are live at a time."""
    w = tuple(chunk_activations(mcfg, st, ch, lay, item) for ch in st.chunks)
    return _peak_live(lay.schedule, lay.pp, lay.m, lay.v, stage, w)


def _peak_live(schedule, p, m, v, stage, weights) -> int:
    if v == 1:
        n = m if schedule == "fthenb" else min(p - stage, m)
        return n * weights[0]
    return max(sum(n * w for n, w in zip(vec, weights)) for vec in _live_counts(schedule, p, m, v, stage))


@functools.lru_cache(maxsize=4096)
def _live_counts(schedule, p, m, v, stage) -> frozenset:
    """The distinct (live caches per chunk) vectors after each forward of the stage's schedule."""
    live, seen = [0] * v, set()
    for a in make_schedule(schedule, p, m, stage, v):
        live[a.chunk] += 1 if a.kind == "F" else -1
        if a.kind == "F":
            seen.add(tuple(live))
    return frozenset(seen)


def buffers(mcfg, st: Stage, lay: Layout, own: int) -> int:
    """Transient bytes: stage >= 2 keeps up to MAX_INFLIGHT + 1 blocks of temporary gradients, stage 3
    two gathered blocks (current and prefetched, + the tied embedding); a recomputed layer is rebuilt
    in backward; pipelines hold two activations; amp unscales the owned gradient into float32."""
    w, g, _, item = precision(mcfg, lay.amp)
    big = max(st.block(b) for b in st.names)
    out = (MAX_INFLIGHT + 1) * big * g if lay.zstage >= 2 else 0
    if lay.zstage == 3:
        out += (2 * big + (st.block("embed") if mcfg.tie_head and "embed" in st.names else 0)) * w
    if lay.recompute and any(recomputed(lay, b) for b in st.names):
        out += block_activations(mcfg, lay, item)["layer"]
    if lay.pp > 1:
        out += 2 * lay.rows * mcfg.seq_len * mcfg.d_model * item
    return out + (4 * own if lay.amp else 0)


# ---- communication ---------------------------------------------------------------------------------

def gathered_per_microbatch(mcfg, st: Stage) -> int:
    """Elements stage 3 gathers per micro-batch and model: every block in forward and again in backward
    (except the embedding, whose backward reads no parameters); a tied head gathers the embedding with
    it both times."""
    tied = mcfg.tie_head and "embed" in st.names and "head" in st.names
    total = 0
    for chunk in st.chunks:
        total += 2 * sum(st.block(b) for b in chunk) - (st.block("embed") if "embed" in chunk else 0)
        if "head" in chunk and tied:
            total += 2 * st.block("embed")
    return total


def traffic(mcfg, st: Stage, lay: Layout, stage: int, models: int, sh_rank=None) -> dict:
    """{axis: {op: bytes}} one rank sends in one optimizer step, as comm.py counts it (every rank
    counts its own buffer of a collective; "tied" is the first/last-stage wte gradient sum)."""
    w, g, _, item = precision(mcfg, lay.amp)
    M, psi, out = models, st.psi * models, {}
    if lay.sh > 1:
        gathers = psi * w if lay.zstage < 3 else lay.k * lay.m * M * gathered_per_microbatch(mcfg, st) * w
        out["sharding"] = {"reduce": psi * g, "allgather": gathers, "allreduce": 2 * F64 * M}
        if lay.dp > 1:
            out["dp"] = {"allreduce": owned(st, lay, M, sh_rank) * g + F64 * M}
    elif lay.dp > 1:
        out["dp"] = {"allreduce": psi * g + F64 * M}
    tokens = lay.share * mcfg.seq_len * M
    if lay.tp > 1:
        per_layer = 4 if mcfg.kind == "gpt" else 2
        ends = ("embed" in st.names) + ("head" in st.names)
        ce = 3 * ("head" in st.names) * (4 if lay.amp else item)     # the loss's max, sum and target logit
        out["tp"] = {"allreduce": tokens * ((per_layer * st.layers + ends) * mcfg.d_model * item + ce) + F64 * M}
    hops = _hops(lay, stage)
    if hops:                 # activations to the next virtual stage, gradients to the previous one
        act = tokens * mcfg.d_model * item * hops
        out["pp"] = {"send": act, "recv": act}
    if lay.pp > 1:
        out["pp"]["allreduce"] = 2 * F64 * M
        if mcfg.tie_head and stage in (0, lay.pp - 1):
            out["tied"] = {"allreduce": M * _wte(mcfg, lay.tp) * g}
    return out


def _hops(lay: Layout, stage: int) -> int:
    """Sends per micro-batch of one rank: forward out of every chunk but the last virtual stage,
    backward out of every chunk but the first."""
    V = lay.pp * lay.v
    return sum((c * lay.pp + stage < V - 1) + (c * lay.pp + stage > 0) for c in range(lay.v))


def _wte(mcfg, tp: int) -> int:
    return -(-mcfg.vocab_size // tp) * mcfg.d_model


def stage_facts(cfg, lay: Layout) -> list[Stage]:
    return stages(cfg.model, lay.tp, lay.pp, lay.v, lay.split)


# ---- time ------------------------------------------------------------------------------------------

def link(lay: Layout, axis: str, cluster, op: str = "allreduce") -> tuple:
    """(latency s, bandwidth B/s) of an operation on a mesh axis: intra-node when its ranks, spaced by
    the degrees of the axes inside it (mesh order, innermost first), fall in one node; a reduce or an
    allgather at its own measured bandwidth where the cluster gives one (between nodes, at most that)."""
    deg = _degrees(lay)
    stride = math.prod(deg[a] for a in lay.order[:lay.order.index(axis)])
    span, gpn = stride * deg[axis], cluster.gpus_per_node
    own = {"reduce": cluster.reduce_bw_gbs, "allgather": cluster.allgather_bw_gbs}.get(op, 0.0) * 1e9
    if span <= gpn and gpn % span == 0:
        return cluster.intra_latency_us * 1e-6, own or cluster.intra_bw_gbs * 1e9
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


def matmul_flops(mcfg, tokens: int, weights: int, layers: int, tp: int, f: int = 6) -> float:
    """f·N·tokens over N weights (f = 6 forward and backward, 8 with recompute), plus the attention
    scores and their product with the values, 2·T·C/tp per token and layer each way."""
    attn = 2 * f * tokens * mcfg.seq_len * mcfg.d_model // tp * layers if mcfg.kind == "gpt" else 0
    return f * tokens * weights + attn


def flops_per_microbatch(mcfg, st: Stage, lay: Layout) -> float:
    """6·N·tokens (8·N with recompute) over the weights this rank multiplies by, plus attention scores."""
    return matmul_flops(mcfg, lay.rows * mcfg.seq_len, st.matmul, st.layers, lay.tp, 8 if lay.recompute else 6)


def _device_flops(mcfg, lay: Layout, cluster) -> float:
    if lay.amp:
        return cluster.tflops * 1e12
    return (cluster.tflops_fp64 if mcfg.dtype == "float64" else cluster.tflops_fp32) * 1e12


def oversubscription(lay: Layout, cluster) -> float:
    """How many of a node's ranks share each CPU core (>= 1): with more ranks on a node than cores
    (cluster.cores_per_node; 0 = a core per device), each computes at that fraction of its rate."""
    cores = cluster.cores_per_node
    ranks = min(lay.tp * lay.sh * lay.dp * lay.pp, cluster.gpus_per_node)
    return max(1.0, ranks / cores) if cores else 1.0


def compute_s(mcfg, st: Stage, lay: Layout, cluster) -> float:
    """Seconds of one micro-batch of one model through the stage on one device (or core): its matmul
    FLOPs at the sustained rate; on CPUs (calibrated block_us, act_ns) also a fixed overhead per block
    pass (forward, backward, and a recomputed block's second forward) and the elementwise passes
    (layernorm, softmax, GELU, residuals) over the activations the forward caches, by their bytes (a
    second forward: about half of its layer's again)."""
    item = precision(mcfg, lay.amp)[3]
    again = sum(recomputed(lay, b) for b in st.names)
    a = block_activations(mcfg, lay, item)
    cached = sum(a[b if b in ("embed", "head") else "layer"] for b in st.names) + again * a["layer"] / 2
    return (flops_per_microbatch(mcfg, st, lay) / _device_flops(mcfg, lay, cluster)
            + (2 * len(st.names) + again) * cluster.block_us * 1e-6 + cached / 4 * cluster.act_ns * 1e-9)


# small allreduces a step makes on each axis: squared gradient norms (sharding, pp, tp), losses (sharding, dp, pp)
SCALAR_CALLS = {"sharding": 2, "dp": 1, "pp": 2, "tp": 1}


def _degrees(lay: Layout) -> dict:
    return {"tp": lay.tp, "sharding": lay.sh, "dp": lay.dp, "pp": lay.pp}


def stage_times(mcfg, st: Stage, lay: Layout, stage: int, models: int, cluster, sh_rank=None) -> dict:
    """Seconds per micro-batch (compute, tp, pp: on the critical path) and per step (dp, sharding:
    exposed after overlapping the last backward / the forward prefetch; fixed: the optimizer over the
    owned elements, the scalar allreduces and the per-step overhead)."""
    tr, M = traffic(mcfg, st, lay, stage, models), models
    slow = oversubscription(lay, cluster)
    comp = slow * M * compute_s(mcfg, st, lay, cluster)
    mb = lay.k * lay.m
    own = owned(st, lay, M, sh_rank) if lay.zstage else st.psi * M
    K = precision(mcfg, lay.amp)[2]                  # optimizer_ns is measured in float32 (K = 8 bytes)
    fixed = slow * (cluster.optimizer_ns * 1e-9 * own * K / 8 + cluster.step_overhead_us * 1e-6)
    deg = _degrees(lay)
    fixed += sum(collective_s("allreduce", deg[a], 0, c, *link(lay, a, cluster)) for a, c in SCALAR_CALLS.items())
    out = {"compute": comp, "tp": 0.0, "pp": 0.0, "dp": 0.0, "sharding": 0.0, "fixed": fixed}
    if "tp" in tr:
        calls = M * ((4 if mcfg.kind == "gpt" else 2) * st.layers + ("embed" in st.names) + 3 * ("head" in st.names))
        out["tp"] = collective_s("allreduce", lay.tp, tr["tp"]["allreduce"] / mb, calls, *link(lay, "tp", cluster))
    if "pp" in tr:
        out["pp"] = collective_s("send", 2, tr["pp"]["send"] / mb, _hops(lay, stage) * M, *link(lay, "pp", cluster))
    hide = cluster.overlap * comp           # what may hide gradient sync: the last backward, 2/3 of a micro-batch
    if "dp" in tr:
        a, b = link(lay, "dp", cluster)
        calls = 1 if lay.sh > 1 else max(1, math.ceil(tr["dp"]["allreduce"] / (lay.bucket_mb * 2**20)))
        t = collective_s("allreduce", lay.dp, tr["dp"]["allreduce"], calls, a, b)
        out["dp"] = t if lay.sh > 1 else max(0.0, t - 2 / 3 * hide)
    if "sharding" in tr:
        parts = len(st.names) * M + lay.sh - 1          # a reduce per (block, owner) piece
        red = collective_s("reduce", lay.sh, tr["sharding"]["reduce"], parts,
                           *link(lay, "sharding", cluster, "reduce"))
        # stage 3 gathers each block from its owner, twice a micro-batch; stages 1-2 share every range once
        gathers = mb * M * (2 * len(st.names) - ("embed" in st.names)) if lay.zstage == 3 else 1
        gat = collective_s("allgather", lay.sh, tr["sharding"]["allgather"], gathers,
                           *link(lay, "sharding", cluster, "allgather" if lay.zstage == 3 else "allreduce"))
        prefetch = mb * hide / 3 if lay.zstage == 3 else 0.0
        out["sharding"] = max(0.0, red - 2 / 3 * hide) + max(0.0, gat - prefetch)
    return out


def predict_stage(mcfg, st: Stage, lay: Layout, stage: int, models: int, cluster=None, sh_rank=None) -> dict:
    """Memory (bytes) and traffic of one rank of `stage`; times when a cluster is given."""
    item = precision(mcfg, lay.amp)[3]
    mem = model_state(mcfg, st, lay, models, sh_rank)
    mem["activations"] = activations(mcfg, st, lay, stage, item)
    mem["buffers"] = buffers(mcfg, st, lay, owned(st, lay, models, sh_rank))
    mem["total"] = sum(mem.values())
    out = {"stage": stage, "memory": mem, "traffic": traffic(mcfg, st, lay, stage, models, sh_rank)}
    if cluster is not None:
        out["times"] = stage_times(mcfg, st, lay, stage, models, cluster, sh_rank)
    return out


def step_time(per_stage: list[dict], lay: Layout) -> dict:
    """Combine stages: the slowest micro-batch sets the pipeline's pace (plus the schedule's bubble),
    then the slowest stage's exposed gradient sync and parameter sharing. With more ranks than cores,
    a rank waiting in the bubble still takes its share of a core (MPI waits by polling), so the
    bubble, like the compute, runs at the oversubscribed pace."""
    slow = max(per_stage, key=lambda s: s["times"]["compute"] + s["times"]["tp"] + s["times"]["pp"])["times"]
    t_mb = slow["compute"] + slow["tp"] + slow["pp"]
    f = bubble_fraction(lay.schedule, lay.pp, lay.m, lay.v) if lay.pp > 1 else 0.0
    per_pass = lay.m * t_mb / (1 - f)
    sync = max(per_stage, key=lambda s: s["times"]["dp"] + s["times"]["sharding"] + s["times"]["fixed"])["times"]
    n = lay.k * lay.m
    out = {"compute": n * slow["compute"], "tp": n * slow["tp"], "pp": n * slow["pp"], "dp": sync["dp"],
           "sharding": sync["sharding"], "fixed": sync["fixed"], "bubble": lay.k * (per_pass - lay.m * t_mb)}
    out["step"] = lay.k * per_pass + sync["dp"] + sync["sharding"] + sync["fixed"]
    return out


def for_rank(cfg, world: int, coords: dict, cluster=None) -> dict:
    """The prediction for the rank at mesh `coords` (its pipeline stage and sharding share)."""
    lay = layout_of(cfg, world)
    st = stage_facts(cfg, lay)[coords["pp"]]
    return predict_stage(cfg.model, st, lay, coords["pp"], cfg.train.models, cluster, coords["sharding"])
