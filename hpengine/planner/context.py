"""The planner's model of context parallelism (strategies/context_parallel.py, docs/context-parallel.md): a
rank holds T / cp tokens of every sequence (the models' cache_bytes take the degree), every layer's attention
sends this rank's keys and values around the ring (or gathers them once), and gradients are summed over
dp x cp (Resolved.grad_group). Here: the bytes each pass sends, the rank's positions a pass's caches share,
and the ring's time on the critical path."""
from __future__ import annotations

from hpengine.models import capabilities
from hpengine.nn.ring_attention import context_positions_bytes
from hpengine.planner import recompute as rc


def heads(mcfg, tp: int) -> tuple:
    """(key/value heads per tp rank, head width): what travels per token."""
    caps = capabilities(mcfg)
    return caps.kv_heads // tp, caps.v_width


def layer_passes(st, lay) -> int:
    """Attention forwards of the stage per micro-batch: each layer once, a fully recomputed one twice."""
    return st.layers + sum(1 for b in st.kinds if b.kind == "layer" and b.name in rc.full(st, lay))


def per_layer(mcfg, lay, item: int) -> dict:
    """{op: bytes} one layer's attention sends per micro-batch: (forward bytes, backward bytes) per op. The
    ring: k and v of this rank's Tk tokens cp - 1 times each pass (and their positions, forward only), and
    backward the dk, dv sums cp times (in the compute dtype, float32 at least); the all-gather: every rank's
    k and v once (the counter takes the whole buffer), their gradients reduce-scattered once."""
    cp, B, T = lay.cp, lay.rows, mcfg.seq_len
    K, hd = heads(mcfg, lay.tp)
    Tk, ct = T // cp, max(item, 4)
    if lay.cp_comm == "ring":
        kv = 2 * B * Tk * K * hd * (cp - 1) * item
        return {"send": (kv + 8 * Tk * (cp - 1), kv + 2 * B * Tk * K * hd * cp * ct)}
    return {"allgather": (2 * B * T * K * hd * item, 0), "reduce_scatter": (0, 2 * B * T * K * hd * ct)}


def traffic(mcfg, st, lay, item: int, models: int) -> dict:
    """{op: bytes} this rank sends (and receives) on the cp communicator in one optimizer step."""
    mb, fwd, layers = lay.k * lay.m * models, layer_passes(st, lay), st.layers
    out = {op: mb * (fwd * f + layers * b) for op, (f, b) in per_layer(mcfg, lay, item).items()}
    if "send" in out:
        out["recv"] = out["send"]
    return out


def positions_bytes(mcfg, st, lay, chunk) -> int:
    """The rank's own global positions, referenced by every layer cache of a pass through `chunk` (counted
    once per chunk and micro-batch; a fully recomputed layer keeps only its input)."""
    if lay.cp == 1 or not any(st.kind_of[b].kind == "layer" and b not in rc.full(st, lay) for b in chunk):
        return 0
    return context_positions_bytes(mcfg.seq_len // lay.cp)


def ring_seconds(mcfg, st, lay, item: int, models: int, compute_s: float, alpha: float, beta: float) -> float:
    """Seconds per micro-batch the cp exchange adds to the critical path. The ring: each of the cp - 1
    forward steps and cp backward steps sends one block while the held block is computed, so a step costs
    max(0, transfer - the block's compute) (the compute split evenly over the 2 cp - 1 steps of every
    attention pass); the all-gather's collectives are counted whole (nothing overlaps them)."""
    per = per_layer(mcfg, lay, item)
    fwd, layers, cp = layer_passes(st, lay), st.layers, lay.cp
    if lay.cp_comm != "ring":
        f = sum(v[0] for v in per.values())
        b = sum(v[1] for v in per.values())
        share = (cp - 1) / cp
        return models * (fwd * (share * f / beta + alpha) + layers * (share * b / beta + alpha))
    f, b = per["send"]
    block = compute_s / max(1, (fwd + layers) * (2 * cp - 1)) if cp > 1 else 0.0
    step_f = max(0.0, f / (cp - 1) / beta + 2 * alpha - block)
    step_b = max(0.0, b / cp / beta + 2 * alpha - block)        # k/v and the dk/dv sums: two messages a step
    return models * (fwd * (cp - 1) * step_f + layers * cp * step_b)
