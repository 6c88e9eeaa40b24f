"""DiLoCo's outer exchange for the planner: the bytes one rank counts on the replica communicator per optimizer
step (its owned pseudo-gradient once every inner_steps steps, per fragment, in the optimizer's dtype or in int8 /
int4 blocks of whole tensors: an alltoallv of the chunks, an allgatherv of the averaged chunks; the scales' MAX
inside the island), and the time a link takes for them (runtime.replica_link, else the cluster's between nodes).
"""
from __future__ import annotations

from bisect import bisect_right

from hpengine.config.tree import parse_link
from hpengine.params.blocks import fragment_plan, tensor_blocks
from hpengine.params.buffers import partition

BLOCK = 256         # values per quantisation block, one float32 scale each (strategies/quantize.py)


def _fragments(lo: int, hi: int, sizes, fragments: int):
    """Per fragment: its tensors (indices into sizes) and the pieces of them inside the owned range [lo, hi), each
    (tensor, start, stop) inside the tensor. Which fragment a tensor joins is estimated from the stage's own tensors
    (in min(F, tensors) groups; strategies/diloco.py groups the whole model's), which leaves a period's calls and its
    tensors' pieces exact."""
    starts = [r.start for r in partition(sizes, min(fragments, len(sizes)), "tensor")] if sizes else [0]
    members, pieces, at = [[] for _ in range(fragments)], [[] for _ in range(fragments)], 0
    for t, n in enumerate(sizes):
        f = bisect_right(starts, at) - 1
        members[f].append(t)
        if max(lo, at) < min(hi, at + n):
            pieces[f].append((t, max(lo, at) - at, min(hi, at + n) - at))
        at += n
    return members, pieces


def fragment_pieces(lo: int, hi: int, sizes, fragments: int) -> list[list[int]]:
    """Per fragment, the lengths of the pieces of the stage's tensors (sizes: element counts in layout order) inside
    the owned range [lo, hi) (a fragment is a group of whole tensors of the whole model, so a period moves every
    tensor's piece once, uncut)."""
    return [[b - a for _, a, b in fr] for fr in _fragments(lo, hi, sizes, fragments)[1]]


def plans(owned: tuple[int, int], sizes, boxes, fragments: int) -> list:
    """Per fragment, the rank's Plan of its pieces over the blocks of whole tensors (params/blocks.py; boxes: each
    tensor's (spec, the global slices this rank holds), sizes' order)."""
    members, pieces = _fragments(*owned, sizes, fragments)
    out = []
    for mem, fr in zip(members, pieces):
        base, at = {}, 0
        for t in mem:
            base[t], at = at, at + tensor_blocks(boxes[t][0], BLOCK)
        out.append(fragment_plan([(*boxes[t], a, b, base[t]) for t, a, b in fr], at, BLOCK))
    return out


def exchanges(dl, islands: int, owned: tuple[int, int], sizes, item: int, boxes) -> list[tuple[str, int]]:
    """(op, bytes as comm.py counts them) of each call one outer period makes: an allreduce of a fragment's owned
    pseudo-gradient in the optimizer's dtype (item bytes), or the island's payload sent out in chunks (alltoallv,
    counted as the whole payload) and the averaged chunks gathered (allgather of one payload's bytes; the chunks are
    the same pieces in the same format); owned: (start, stop) of the rank's part of the stage, sizes: the stage's
    tensor sizes, boxes: plans()'."""
    if dl.quantize == "none":
        return [("allreduce", sum(p) * item) for p in fragment_pieces(*owned, sizes, dl.fragments)]
    return [(op, sum(p.counts(dl.quantize, islands, BLOCK))) for p in plans(owned, sizes, boxes, dl.fragments)
            for op in ("alltoallv", "allgather")]


def block_max_traffic(dl, lay, island: int, owned: tuple, sizes, boxes) -> dict:
    """{axis: {"allreduce": bytes per step}} of the int8/int4 scales' MAX inside an island (tp, and sharding when its
    partition cuts tensors): a float32 per block of each fragment's tensors here when the island quantises its
    values, and per block of its own chunk when it re-quantises the mean."""
    axes = [a for a, on in (("tp", lay.tp > 1), ("sharding", lay.sh > 1 and lay.partition == "flat")) if on]
    if dl.quantize == "none" or not axes:
        return {}
    per = 0
    for p in plans(owned, sizes, boxes, dl.fragments):
        lo, hi = p.block_span(island, lay.islands)
        per += 4 * p.blocks + 4 * (hi - lo)
    return {a: {"allreduce": per / dl.inner_steps} for a in axes}


def traffic(dl, islands: int, owned: tuple, sizes, item: int, boxes) -> dict:
    """{op: bytes} per optimizer step on the replica communicator (a period's calls over inner_steps)."""
    out = {}
    for op, b in exchanges(dl, islands, owned, sizes, item, boxes):
        out[op] = out.get(op, 0) + b / dl.inner_steps
    return out


def link_of(runtime, cluster) -> tuple[float, float, str]:
    """(bytes per second, latency in seconds, its name) of the islands' link: runtime.replica_link when set, else
    the cluster's between nodes."""
    if runtime.replica_link:
        rate, latency = parse_link(runtime.replica_link)
        return rate, latency, f"runtime.replica_link {runtime.replica_link}"
    return (cluster.inter_bw_gbs * 1e9, cluster.inter_latency_us * 1e-6,
            f"the cluster's link between nodes ({cluster.inter_bw_gbs:g} GB/s, {cluster.inter_latency_us:g} us)")


def seconds_per_step(dl, islands: int, owned: tuple, sizes, item: int, boxes, rate: float, latency: float) -> float:
    """The link's time for one period's calls (latency + bytes / rate each, as runtime.replica_link simulates it)
    over inner_steps: the mean cost per optimizer step, exposed unless overlap hides it under the inner steps."""
    return sum(latency + b / rate for _, b in exchanges(dl, islands, owned, sizes, item, boxes)) / dl.inner_steps


def norm_traffic(dl, lay, models: int) -> dict:
    """{axis: {"allreduce": bytes per step}} of the outer metrics: every fragment's exchange takes two global norms
    (the island's drift, the mean pseudo-gradient), a float64 per model summed over sharding, pp and tp (and ep
    with experts split) like the clipping norm."""
    per = 2 * dl.fragments * 8 * models / dl.inner_steps
    axes = [a for a, d in (("sharding", lay.sh), ("pp", lay.pp), ("tp", lay.tp), ("ep", lay.ep)) if d > 1]
    return {a: {"allreduce": per} for a in axes}


def state_bytes(dl, owned: int, item: int) -> int:
    """Bytes of the outer state over `owned` elements in the optimizer's dtype (item bytes; strategies/diloco.py
    Outer): the outer parameters, and the momentum, the error-feedback residual and overlap's landed means where
    the run keeps them."""
    kept = 1 + (dl.outer_momentum > 0) + (dl.quantize != "none") + bool(dl.overlap)
    return kept * owned * item
