"""DiLoCo's outer exchange for the planner: the bytes one rank counts on the replica communicator per optimizer
step (its owned pseudo-gradient once every inner_steps steps, per fragment, in the optimizer's dtype or in int8 /
int4 blocks: an alltoallv of the chunks, an allgatherv of the averaged chunks) and the time a link takes for them
(runtime.replica_link, else the cluster's link between nodes).
"""
from __future__ import annotations

from bisect import bisect_right

from hpengine.config.tree import parse_link
from hpengine.params.buffers import partition

BLOCK = 256         # values per quantisation block, one float32 scale each (strategies/quantize.py)


def payload_bytes(pieces, fmt: str) -> int:
    """One island's payload for pieces of tensors (lengths), each from a block boundary: int8 one byte a value,
    int4 half, padded to whole blocks, plus 4 bytes of scale per block."""
    blocks = sum(-(-n // BLOCK) for n in pieces)
    return blocks * BLOCK // (1 if fmt == "int8" else 2) + 4 * blocks


def fragment_pieces(lo: int, hi: int, sizes, fragments: int) -> list[list[int]]:
    """Per fragment, the lengths of the pieces of the stage's tensors (sizes: element counts in layout order) inside
    the owned range [lo, hi). A fragment is a group of whole tensors of the whole model (strategies/diloco.py), so a
    period moves every tensor's piece once, uncut; which call carries which is estimated here from the stage's own
    tensors (in min(F, tensors) groups), which leaves the period's bytes and calls exact."""
    starts = [r.start for r in partition(sizes, min(fragments, len(sizes)), "tensor")] if sizes else [0]
    out, at = [[] for _ in range(fragments)], 0
    for n in sizes:
        if max(lo, at) < min(hi, at + n):
            out[bisect_right(starts, at) - 1].append(min(hi, at + n) - max(lo, at))
        at += n
    return out


def exchanges(dl, islands: int, owned: tuple[int, int], sizes, item: int) -> list[tuple[str, int]]:
    """(op, bytes as comm.py counts them) of each call one outer period makes: an allreduce of a fragment's owned
    pseudo-gradient in the optimizer's dtype (item bytes), or the island's payload sent out in chunks (alltoallv,
    counted as the whole payload) and the averaged chunks gathered (allgather of one payload's bytes; the chunks are
    whole blocks of the same format); owned: (start, stop) of the rank's part of the stage, sizes: the stage's tensor
    sizes."""
    frags = fragment_pieces(*owned, sizes, dl.fragments)
    if dl.quantize == "none":
        return [("allreduce", sum(p) * item) for p in frags]
    return [(op, payload_bytes(p, dl.quantize)) for p in frags for op in ("alltoallv", "allgather")]


def traffic(dl, islands: int, owned: tuple, sizes, item: int) -> dict:
    """{op: bytes} per optimizer step on the replica communicator (a period's calls over inner_steps)."""
    out = {}
    for op, b in exchanges(dl, islands, owned, sizes, item):
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


def seconds_per_step(dl, islands: int, owned: tuple, sizes, item: int, rate: float, latency: float) -> float:
    """The link's time for one period's calls (latency + bytes / rate each, as runtime.replica_link simulates it)
    over inner_steps: the mean cost per optimizer step, exposed unless overlap hides it under the inner steps."""
    return sum(latency + b / rate for _, b in exchanges(dl, islands, owned, sizes, item)) / dl.inner_steps


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
