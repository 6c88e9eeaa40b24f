"""The planner's memory model of one layout: what each rank holds in one optimizer step — ZeRO model states,
the activation caches its schedule keeps live, and transient buffers — from the model's own ParamSpecs and the
engine's partition and schedules, so the figures equal what the engine allocates and counts.
"""
from __future__ import annotations

import functools

from hpengine.config.load import model_from_key, model_key
from hpengine.layout.resolve import MAX_INFLIGHT, Resolved
from hpengine.layout.schedules import peak_live
from hpengine.models import build_model, capabilities
from hpengine.optim.base import UNDECLARED, kind as optimizer_kind
from hpengine.params.buffers import Range, partition
from hpengine.planner import context as plan_cp, moe as plan_moe, recompute as rc, tp as plan_tp
from hpengine.planner.stages import StageFacts, family_key, memoised


def zero_bytes(psi: float, share: float, stage: int, w: int, g: int, k: int) -> tuple:
    """ZeRO (Rajbhandari et al. 2020) model states of a rank owning `share` of `psi` elements:
    (parameters, gradients, optimizer) with w, g, k bytes per element; stage 0 = not sharded."""
    return (w * (share if stage >= 3 else psi), g * (share if stage >= 2 else psi),
            k * (share if stage >= 1 else psi))


def precision(mcfg, amp, packed: bool = False, optimizer: str = UNDECLARED, least: bool = False) -> tuple:
    """(w, g, K, compute bytes): 16-bit copies, and an fp32 master plus the optimizer's state in float32 under
    amp (K = 12 for AdamW's two moments); bfloat16 values are kept in float32 storage (precision.py), so its
    gradients on the wire (MPI has no bfloat16 sum) and activations on the wire take 4 bytes, as do its compute
    copy, cached activations and held gradients unless they are packed (packed_caches: the copy as bfloat16
    bits, w = 2, the caches block_activations, bfloat16 gradients held_grad_bytes); else the dtype for
    parameters, gradients and the optimizer's state (K = 8 for AdamW in float32). K: what `optimizer`
    (optim.name) declares (optim/base.py: OptimizerKind.state_bytes) for the tensors that keep the most state
    values (least: the fewest, a floor; optimizer_bytes counts a layout's tensors exactly)."""
    state = functools.partial(optimizer_kind(optimizer).state_bytes, least=least)
    if amp == "bfloat16":
        return 2 if packed else 4, 4, 4 + state(4), 4
    if amp:
        return 2, 2, 4 + state(4), 2
    item = 8 if mcfg.dtype == "float64" else 4
    return item, item, state(item), item


def buddy_bytes(resilience, mem: dict | None) -> int:
    """Host bytes of resilience's buddy copies per rank (dist/buddy.py): the state a rank holds (its parameters as
    held: the stage's buffer below sharding stage 3, else its shard; its optimizer state, amp's masters included;
    DiLoCo's outer state) and its partner's, for the last 2 steps; 0 when the run keeps none (on_failure = "abort",
    buddy = false)."""
    if mem is None or resilience.on_failure == "abort" or not resilience.buddy:
        return 0
    return 2 * 2 * int(mem.get("params", 0) + mem.get("optimizer", 0) + mem.get("outer", 0))


def owned(st: StageFacts, lay: Resolved, models: int, sh_rank=None) -> int:
    """Elements this sharding rank owns (the largest share when sh_rank is None)."""
    if lay.sh == 1:
        return st.psi * models
    return memoised(st, ("owned", models, lay.sh, lay.partition, sh_rank, lay.experts_whole),
                    lambda: _owned(st, lay, models, sh_rank))


def _owned(st: StageFacts, lay: Resolved, models: int, sh_rank) -> int:
    sizes = st.sizes(models)
    ranges = _partition(sizes, lay.sh, lay.partition)
    per_rank = [r.size for r in ranges]
    if lay.experts_whole:       # ep across sharding: its share less the experts, and its whole expert block
        flagged = plan_tp.flagged_per_rank(sizes, st.expert * models, tuple(ranges))
        per_rank = [n - f + st.experts * models for n, f in zip(per_rank, flagged)]
    return max(per_rank) if sh_rank is None else per_rank[sh_rank]


def owned_experts(st: StageFacts, lay: Resolved, models: int, sh_rank=None) -> int:
    """Elements of expert blocks split over ep inside this sharding rank's owned range (the largest share when
    sh_rank is None): their gradients are averaged over the ep-dp replicas, the rest over dp. With ep across
    sharding every rank owns its whole expert block."""
    if lay.sh == 1 or lay.experts_whole:
        return st.experts * models
    return memoised(st, ("owned experts", models, lay.sh, lay.partition, sh_rank),
                    lambda: _owned_experts(st, lay, models, sh_rank))


def _owned_experts(st: StageFacts, lay: Resolved, models: int, sh_rank) -> int:
    sizes = st.sizes(models)
    per_rank = plan_tp.flagged_per_rank(sizes, st.expert * models, tuple(_partition(sizes, lay.sh, lay.partition)))
    return max(per_rank) if sh_rank is None else per_rank[sh_rank]


@functools.lru_cache(maxsize=4096)
def _partition(sizes, n, mode):
    return partition(list(sizes), n, mode)


def held_grad_bytes(mcfg, lay: Resolved, packed: bool = False) -> int:
    """Bytes a gradient element takes at rest: 2 when bf16 amp packs (packed_caches) bfloat16 gradients
    (amp.grad_dtype = "bfloat16"; their sums still move float32 wire copies), else precision's g."""
    return 2 if packed and lay.bf16_grads else precision(mcfg, lay.amp, packed)[1]


def model_state(mcfg, st: StageFacts, lay: Resolved, models: int, sh_rank=None, packed: bool = False) -> dict:
    """ZeRO model states of this sharding rank; packed (packed_caches): the compute copy in bfloat16 bits, and
    bfloat16 gradients too (held_grad_bytes)."""
    w, _, k, _ = precision(mcfg, lay.amp, packed, lay.optimizer)
    g = held_grad_bytes(mcfg, lay, packed)
    p, gr, o = zero_bytes(st.psi * models, owned(st, lay, models, sh_rank), lay.zstage, w, g, k)
    if dict(st.state_values).get(lay.optimizer) is not None:
        o = optimizer_bytes(mcfg, st, lay, models, sh_rank)
    return {"params": p, "grads": gr, "optimizer": o}


def optimizer_bytes(mcfg, st: StageFacts, lay: Resolved, models: int, sh_rank=None) -> int:
    """Bytes of the optimizer state (and amp's float32 masters) this sharding rank holds (the most any rank holds
    when sh_rank is None), for an optimizer that declares its state values per tensor: a value per element of each
    owned tensor's share for each value it keeps (optim.base.OptimizerKind.values_of), float32 under amp (a master
    per owned element too), else the model's dtype."""
    key = ("optimizer bytes", models, lay.sh, lay.partition, lay.zstage, sh_rank, lay.optimizer, bool(lay.amp),
           mcfg.dtype)
    return memoised(st, key, lambda: _optimizer_bytes(mcfg, st, lay, models, sh_rank))


def _optimizer_bytes(mcfg, st: StageFacts, lay: Resolved, models: int, sh_rank) -> int:
    item, master = (4, 4) if lay.amp else (8 if mcfg.dtype == "float64" else 4, 0)
    sizes, per = st.sizes(models), dict(st.state_values)[lay.optimizer] * models
    total = sum(sizes)
    ranges = _partition(sizes, lay.sh, lay.partition) if lay.sh > 1 and lay.zstage >= 1 else [Range(0, total)]
    best = 0
    for r in ranges if sh_rank is None else [ranges[sh_rank]]:
        at, values = 0, 0
        for n, v in zip(sizes, per):
            values += v * max(0, min(at + n, r.stop) - max(at, r.start))
            at += n
        best = max(best, master * r.size + item * values)
    return best


def packed_caches(lay: Resolved, cluster=None) -> bool:
    """Whether bf16 amp keeps the activation caches and the parameters' compute copy as bfloat16 bits
    (strategy.amp.bf16_storage): "packed", or
    "auto" on a GPU, which runtime.backend = "cupy" says, or, with runtime.backend = "auto", a GPU cluster (any
    cluster without the CPU figures that --calibrate --device cpu measures)."""
    return lay.packs_activations(cluster is not None and not (cluster.block_us or cluster.act_ns))


def _model_cache_bytes(mcfg, lay: Resolved, item: int) -> dict:
    return dict(_cache_bytes_of(model_key(mcfg), lay.tp, lay.rows, item, lay.amp, lay.share, lay.seq_parts, lay.cp,
                                lay.cp_comm, lay.ep))


@functools.lru_cache(maxsize=4096)
def _cache_bytes_of(mkey, tp, rows, item, amp, share, parts, cp, cp_comm, ep) -> dict:
    """The model's cache_bytes, once per model and micro-batch shape (the search asks for the same ones often; a
    model with many MoE layers takes long to count); callers get a copy."""
    mcfg = model_from_key(mkey)
    out = build_model(mcfg, tp).cache_bytes(rows, tp, item, amp, share, parts, cp, cp_comm)
    if ep > 1:
        received = plan_moe.received_cache(mcfg, rows, ep, item)
        for key in [k for k in out if k.startswith("layer.")]:     # the MoE layers
            out[key] += received
        out["head"] += capabilities(mcfg).mtp_depth * received     # the multi-token prediction modules' MoE blocks
    return out


def block_activations(mcfg, lay: Resolved, item: int, packed: bool = False) -> dict:
    """Bytes the engine's forward caches per block kind for one micro-batch (what Engine.cache_peak
    counts), as the model's layers report them; "input" is what a recomputed layer keeps, "scores" what
    selective recompute drops. Under expert parallelism an MoE layer also keeps the rows it received (balanced
    routing: as many as it sent) and their regrouping order, and the exchange's row counts.
    packed (packed_caches, bf16 amp: item 4): every float32 array of a layer's cache and a recomputed layer's
    input in 2 bytes an element, the statistics kept in float32 whatever the dtype (rstd, lse) too; the
    head's (never packed) and the W stash's (what backward unpacked) stay as they are, but for the arrays
    only GEMMs read, which the layers write as bfloat16 bits then (the models' "bits_<kind>" elements: the
    head's linear input, the linears' inputs and the gating's gradients in a W stash). The models' formulas
    are linear in a float item of 4 or more bytes and fixed in their integer parts, so a block's float32
    bytes are its bytes at item 8 less those at item 4, and packing takes half of them off."""
    out = _model_cache_bytes(mcfg, lay, item)
    if packed:
        wide = _model_cache_bytes(mcfg, lay, 2 * item)
        out.update({k: v - (wide[k] - v) // 2 for k, v in out.items()
                    if k not in ("head", "embed") and not k.startswith(("w_", "bits_"))})
        out.update({k: v - out[f"bits_{k}"] * (item - 2) for k, v in out.items() if f"bits_{k}" in out})
    return out


def chunk_activations(mcfg, st: StageFacts, chunk, lay: Resolved, item: int, packed: bool = False) -> int:
    """Cached bytes of one micro-batch through one chunk: a recomputed layer keeps only its input (or,
    selective, all but its probabilities). Caches hold no weights (backward is handed them), so stage 3
    frees gathered blocks after use."""
    a = block_activations(mcfg, lay, item, packed)
    return sum(rc.cached(a, st, lay, b) for b in chunk) + plan_cp.positions_bytes(mcfg, st, lay, chunk)


def activations(mcfg, st: StageFacts, lay: Resolved, stage: int, item: int, packed: bool = False) -> int:
    """_activations, memoised on the stage: it reads none of the sharding x dp split (stages.family_key)."""
    return memoised(st, ("activations", family_key(lay), stage, item, packed),
                    lambda: _activations(mcfg, st, lay, stage, item, packed))


def _activations(mcfg, st: StageFacts, lay: Resolved, stage: int, item: int, packed: bool = False) -> int:
    """Peak cached bytes on this stage: the schedule's live (micro-batch, chunk) caches, weighted by
    chunk (F-then-B holds m, 1F1B min(p - s, m), interleaved per Megatron 2021), and under a zero-bubble
    schedule the W stashes between each B and its W. Several models run
    their passes one after another, so one model's caches are live at a time."""
    w = tuple(chunk_activations(mcfg, st, ch, lay, item, packed) for ch in st.chunks)
    return peak_live(lay.schedule, lay.pp, lay.m, lay.v, stage, w,
                     tuple(chunk_stash(mcfg, st, ch, lay, item, packed) for ch in st.chunks))


def chunk_stash(mcfg, st: StageFacts, chunk, lay: Resolved, item: int, packed: bool = False) -> int:
    """A split backward's W stash of one micro-batch through one chunk: what its blocks' deferred
    weight-gradient work holds from B to W (the same whether or not a layer was recomputed)."""
    a = block_activations(mcfg, lay, item, packed)
    return sum(rc.of_block(a, st.kind_of[b], "w_" + st.kind_of[b].kind) for b in chunk)


def buffers(mcfg, st: StageFacts, lay: Resolved, own: int, packed: bool = False) -> int:
    """Transient bytes: stage >= 2 keeps up to MAX_INFLIGHT + 1 blocks of temporary gradients, stage 3
    two gathered blocks (current and prefetched, + the tied embedding); a recomputed layer is rebuilt
    in backward, and packed caches (packed_caches) are unpacked one layer at a time for its backward, as are
    packed parameters (one block's float32 tensors but the linears' weights, which the GEMMs read as bits, with
    the blocks it reads) and packed bfloat16 gradients (a
    block's float32 scratch, with the blocks it reads, and up to MAX_INFLIGHT + 1 float32 wire copies of a
    block or a bucket in their sums); pipelines hold two activations; amp unscales the owned gradient into
    float32 (packed gradients: their float32 values for the update)."""
    w, _, _, item = precision(mcfg, lay.amp, packed)
    g = held_grad_bytes(mcfg, lay, packed)
    big = max(st.block(b) for b in st.names)
    out = (MAX_INFLIGHT + 1) * big * g if lay.zstage >= 2 else 0
    if packed and lay.bf16_grads and lay.replicas * lay.cp > 1:
        wire = big if lay.sh > 1 else min(sum(st.block(b) for b in st.names), big + int(lay.bucket_mb * 2**20) // 4)
        out += (MAX_INFLIGHT + 1) * wire * 4
    if packed and lay.bf16_grads:
        out += 4 * (big + sum(st.block(d) for d in _read_blocks(st)))
    if lay.zstage == 3:
        out += (2 * big + sum(st.block(d) for d in _read_blocks(st))) * w
    a = block_activations(mcfg, lay, item)
    out += rc.transient(a, st, lay)
    if packed:
        out += max((rc.cached(a, st, lay, b.name) for b in st.kinds if b.kind == "layer"), default=0)
        unpacked = dict(st.unpacked)
        out += 4 * (max(unpacked.values(), default=0) + sum(unpacked[d] for d in _read_blocks(st)))
    if lay.pp > 1:
        out += 2 * lay.rows * mcfg.seq_len // (lay.seq_parts * lay.cp) * mcfg.d_model * item
    return out + (4 * own if lay.amp else 0)


def _read_blocks(st: StageFacts, blocks=None) -> list[str]:
    """Blocks of this stage whose tensors another block of it (of `blocks`) reads: gathered with it too."""
    return [d for b, ds in st.deps if blocks is None or b in blocks for d in ds]
