"""The planner's model of activation recomputation (strategy.recompute): which layers of a stage keep
only their input (granularity "full") or all but their attention probabilities ("selective"), what
each block caches, and the work backward adds to rebuild what forward dropped. The head and the
embedding are never recomputed."""
from __future__ import annotations

from hpengine.models import build_model


def full(st, lay) -> frozenset:
    """Names of the stage's layers that keep only their input."""
    key = ("full", lay.recompute, lay.granularity)        # all that Resolved.recomputed reads
    if key not in st.memo:
        st.memo[key] = frozenset(b.name for b in st.kinds if lay.recomputed(b))
    return st.memo[key]


def selective(st, lay) -> frozenset:
    """Names of the stage's layers that drop their attention probabilities (when they have any)."""
    key = ("selective", lay.recompute, lay.granularity)
    if key not in st.memo:
        st.memo[key] = frozenset(b.name for b in st.kinds if lay.drops_scores(b))
    return st.memo[key]


def of_block(a: dict, b, key: str | None = None) -> int:
    """The model's cache_bytes entry `key` (default: the block's kind) for block b: a layer that differs from
    the others (an MoE layer) has its own entry "{key}.{layer}"."""
    key = key or b.kind
    return a.get(f"{key}.{b.layer}", a[key])


def cached(a: dict, st, lay, block: str) -> int:
    """Bytes one micro-batch leaves cached by `block`, from the model's cache_bytes `a`."""
    b = st.kind_of[block]
    if lay.recomputed(b):
        return a["input"]
    return of_block(a, b) - (a["scores"] if lay.drops_scores(b) else 0)


def transient(a: dict, st, lay) -> int:
    """Bytes backward rebuilds for one layer at a time: a whole layer's cache, or its probabilities."""
    rebuilt = [of_block(a, st.kind_of[n]) for n in full(st, lay)]
    return max(max(rebuilt, default=0), a["scores"] if selective(st, lay) else 0)


def extra_flops(mcfg, st, lay, tokens: int) -> float:
    """Matmul FLOPs of one micro-batch's rebuilding: a fully recomputed layer runs its forward again
    (2·N·tokens over its weights plus its attention forward); a selective one only its score GEMM QK^T,
    half the attention forward, and only where it has probabilities to drop (none for the mlp kind or
    flash attention). The softmax's elementwise work is counted with the bytes (elementwise_bytes)."""
    model, again = build_model(mcfg, lay.tp), full(st, lay)
    att = model.attention_flops(tokens, lay.tp)
    if st.attention != 1.0:      # packed documents: the share of the work they leave
        att *= st.attention
    out = sum(2 * tokens * n for b, n in st.matmuls if b in again) + att * len(again)
    if model.cache_bytes(lay.rows, lay.tp, 1, lay.amp, lay.share, cp=lay.cp)["scores"]:
        out += att // 2 * len(selective(st, lay))
    return out


def elementwise_bytes(a: dict, st, lay) -> float:
    """Cached bytes the rebuilding passes over elementwise: about half of a fully recomputed layer's
    cache again, all of a selective layer's probabilities (mask, max, exp, sum and scale)."""
    return len(full(st, lay)) * a["layer"] / 2 + len(selective(st, lay)) * a["scores"]
