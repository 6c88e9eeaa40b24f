"""The planner's model of tensor-parallel traffic: the activation collectives of the tp regions (allreduces,
or under sequence parallelism all-gathers and reduce-scatters), the loss statistics, the once-a-step sum of
the replicated tensors' gradients (under sequence parallelism every whole tensor's, else only those applied
per head, layout/reduction.py), and pipeline sends split across tp."""
from __future__ import annotations

import bisect
import functools

from hpengine.models import build_model, capabilities
from hpengine.planner import recompute as rc


def activation_calls(mcfg, st, lay) -> dict:
    """Collectives of a (B, T, C) activation per micro-batch through the stage, by operation. A layer has
    `a` region exits forward (the attention and the MLP: 2; the mlp kind: 1) and `a` entries backward; a
    recomputed layer runs its forward again. Plain tp: each is an allreduce, plus the embedding's forward
    and the head's backward. Sequence parallel: an entry all-gathers forward and reduce-scatters
    backward, an exit the reverse, and an entry's linear gathers its input again in backward (those the model's
    sp_regathers counts); the
    embedding reduce-scatters forward and gathers backward; the head gathers forward, again in backward,
    and reduce-scatters. An MoE layer's routed MLP keeps the sequence it gathered, so its backward gathers
    once less. A multi-token prediction module (with the head) embeds and takes a loss as the ends do."""
    a, _ = build_model(mcfg, lay.tp).tp_allreduces()
    layers, again = st.layers, len(rc.full(st, lay))
    ends = len(st.of_kind("embed")) + mtp_modules(mcfg, st), losses(mcfg, st)
    if not lay.sp:
        return {"allreduce": 2 * a * layers + a * again + sum(ends)}
    r = build_model(mcfg, lay.tp).sp_regathers()
    return {"allgather": (2 * a + r) * layers + a * again + ends[0] + 2 * ends[1] - moe_layers(mcfg, st),
            "reduce_scatter": 2 * a * layers + a * again + ends[0] + ends[1]}


def bits_gathers(mcfg, st, lay) -> int:
    """Of the all-gathers of activation_calls, those whose activation only GEMMs read (a region entry's norm
    output, forward, again for the linear's weight gradient and in a recomputed layer's forward; the head's
    the same), which packed bf16 storage moves as bfloat16 bits. An MoE layer's MLP entry is not one: the
    router reads its input in float32."""
    if not lay.sp:
        return 0
    model = build_model(mcfg, lay.tp)
    a, r = model.tp_allreduces()[0], model.sp_regathers()
    again = rc.full(st, lay)
    routed = _routed(mcfg)
    moe_again = sum(routed(st.kind_of[n]) for n in again)
    return (a + r) * st.layers + a * len(again) + 2 * losses(mcfg, st) - 2 * moe_layers(mcfg, st) - moe_again


def _routed(mcfg):
    moe = build_model(mcfg).moe
    return lambda b: moe is not None and b.kind == "layer" and moe.routed(b.layer)


def mtp_modules(mcfg, st) -> int:
    """The multi-token prediction modules the stage runs (with its head)."""
    return capabilities(mcfg).mtp_depth * len(st.of_kind("head"))


def losses(mcfg, st) -> int:
    """Vocabulary-parallel losses per micro-batch through the stage: the head's and each MTP module's."""
    return len(st.of_kind("head")) + mtp_modules(mcfg, st)


def moe_layers(mcfg, st) -> int:
    """The stage's blocks with routed experts (an MoE model's MTP modules' too): each sums its gates' (tokens,
    top_k) gradient over tp in backward."""
    return sum(map(_routed(mcfg), st.kinds)) + (mtp_modules(mcfg, st) if capabilities(mcfg).experts else 0)


def replicated_owned(st, lay, models: int, partition_of, sh_rank=None) -> int:
    """Elements inside this rank's owned range (the largest over sharding ranks when sh_rank is None) of the
    tensors whose gradients are summed over tp once a step: under sequence parallelism every tensor each tp
    rank holds whole, else those of them applied per head (ParamSpec.tp_partial, the q/k norms)."""
    key = ("replicated owned", lay.sp, models, lay.sh, lay.partition if lay.sh > 1 else "", sh_rank)
    if key not in st.memo:
        st.memo[key] = _replicated_owned(st, lay, models, partition_of, sh_rank)
    return st.memo[key]


def _replicated_owned(st, lay, models: int, partition_of, sh_rank) -> int:
    flags = st.replicated if lay.sp else st.partial
    if not any(flags):
        return 0
    sizes, flags = st.sizes(models), flags * models
    if lay.sh == 1:
        return sum(n for n, f in zip(sizes, flags) if f)
    per_rank = flagged_per_rank(sizes, flags, tuple(partition_of(sizes, lay.sh, lay.partition)))
    return max(per_rank) if sh_rank is None else per_rank[sh_rank]


@functools.lru_cache(maxsize=1024)
def flagged_per_rank(sizes, flags, ranges) -> tuple:
    """Elements of the flagged tensors inside each owned range (ranges: the partition, in flat-buffer order)."""
    starts, below, at, total = [], [], 0, 0      # below[i]: flagged elements before the i-th flagged span
    spans = []
    for n, f in zip(sizes, flags):
        if f:
            starts.append(at)
            below.append(total)
            spans.append((at, at + n))
            total += n
        at += n

    def upto(x: int) -> int:         # flagged elements at offsets < x
        i = bisect.bisect_right(starts, x) - 1
        return 0 if i < 0 else below[i] + min(x, spans[i][1]) - spans[i][0]
    return tuple(upto(r.stop) - upto(r.start) for r in ranges)


# Bytes as comm.py counts them: an allreduce and a
# reduce-scatter count the buffer sent, an all-gather the buffer gathered.
def traffic(mcfg, st, lay, tokens: int, item: int, g: int, loss_item: int, scalars: int, replicated: int,
            packed: bool = False) -> dict:
    """{op: bytes} on the tp communicator in one step: `tokens` of the step through the stage, activations
    of `item` bytes, gradients of `g`; the loss's max, sum and target logit per head in `loss_item` bytes;
    `scalars` bytes of squared norms; `replicated` elements of gradients summed over tp once a step; packed
    (bf16 storage): the all-gathers of bits_gathers move 2 bytes an element."""
    C = mcfg.d_model
    ce = 3 * losses(mcfg, st) * loss_item
    out = {op: tokens * n * C * item for op, n in activation_calls(mcfg, st, lay).items()}
    if packed and "allgather" in out:
        out["allgather"] -= tokens * bits_gathers(mcfg, st, lay) * C * (item - 2)
    gates = tokens * capabilities(mcfg).top_k * item * moe_layers(mcfg, st)
    out["allreduce"] = out.get("allreduce", 0) + tokens * ce + scalars + replicated * g + gates
    return out


# Pipeline sends split across tp: each tp
# rank sends 1/tp, the receiving stage all-gathers.
def pipeline_bytes(mcfg, lay, tokens: int, item: int, hops: int) -> tuple:
    """(bytes sent = received over pp, bytes all-gathered over tp) per step: an activation or its
    gradient per hop, 1/tp of it under sequence parallelism or when sends are split across tp."""
    whole = tokens * mcfg.d_model * item * hops
    if lay.sp:
        return whole // lay.tp, 0
    if lay.scatter:
        return whole // lay.tp, whole
    return whole, 0


def tp_seconds(mcfg, st, lay, models: int, per_mb: dict, link_of, collective_s) -> float:
    """Seconds per micro-batch of the tp collectives: `per_mb` {op: bytes per micro-batch}; an all-gather
    and a reduce-scatter move (n-1)/n of their bytes, an allreduce twice that; latency per call."""
    calls = activation_calls(mcfg, st, lay)
    heads = losses(mcfg, st)
    total = 0.0
    for op, nbytes in per_mb.items():
        n_calls = models * (calls.get(op, 0) + (2 * heads + moe_layers(mcfg, st) if op == "allreduce" else 0))
        kind = "reduce" if op == "reduce_scatter" else op
        total += collective_s(kind, lay.tp, nbytes, max(n_calls, 1), *link_of("allreduce"))
    return total


def pipeline_gather_seconds(lay, gathered_per_mb: float, hops: int, models: int, link_of, collective_s) -> float:
    """The receiving stage's all-gather over tp of split sends, per micro-batch."""
    if not gathered_per_mb:
        return 0.0
    return collective_s("allgather", lay.tp, gathered_per_mb, hops * models, *link_of("allreduce"))

