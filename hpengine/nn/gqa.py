"""Causal grouped-query attention: H query heads share K key/value heads (g = H / K queries per group;
K = H is multi-head attention, K = 1 multi-query), the group's queries folded into one GEMM's rows so
keys and values are never repeated per query head. Packed documents (segments): a query sees only the keys
of its own document.
"""
from hpengine.device.bf16_bits import as_float32, to_bf16_bits
from hpengine.nn import fused
from hpengine.nn.attention import _blocks, _causal_bias, _mm, _rowsum, same_document, softmax_grad
from hpengine.nn.numerics import OFF


# Inputs come head-major from the rotary embedding: q (B, H, T, hd), already rotated and scaled by
# 1/sqrt(hd); k (B, K, T, hd); v (B, K, T, dv) in any strides (the projection's output seen per head; dv is hd
# but for multi-head latent attention, nn/mla.py).
# The g query heads of a group and a block of query rows fold into one row axis, so every product is
# one GEMM per (batch row, kv head) whose rows are all the group's queries: the keys and values are
# never repeated per query head, and backward's dk and dv sum over the group inside the GEMM. Query rows
# come in the same two causal blocks as nn/attention.py (the fully masked quarter is never computed), and the
# probabilities are stored as there (bfloat16 bits under bf16 amp, packed).
def _grouped(a, K, g, a0, b0):
    # rows a0..b0 of (B, K*g, T, hd) or of a (B, K, g, T, hd) view -> (B, K, g*(b0-a0), hd); copies when g > 1
    B, hd = a.shape[0], a.shape[-1]
    return a.reshape(B, K, g, -1, hd)[:, :, :, a0:b0].reshape(B, K, g * (b0 - a0), hd)


def _per_head(a, K, g):
    # (B, T, K*g*hd) -> the view (B, K, g, T, hd)
    B, T, _ = a.shape
    return a.reshape(B, T, K, g, -1).transpose(0, 2, 3, 1, 4)


def _softmax(xp, p, a, num, segments=None):
    # the probabilities of grouped scores p (B, K, g*n, b) of query rows a .. a+n-1 (repeated per head), as
    # they are stored (num.store_for_gemm): computed in place in p (a new array under segments)
    B, K, gn, b = p.shape
    n = b - a
    p5 = p.reshape(B, K, gn // n, n, b)
    if segments is not None:        # -inf outside the query's document: exact zeros after exp
        p5 = xp.where(same_document(xp, segments, a, b, 0, b)[:, None], p5, -xp.inf)
        p = p5.reshape(p.shape)
    if segments is None and fused.usable(xp, p5) and p5.flags.c_contiguous:
        if num.writes_bits and p.dtype == xp.float32:
            return fused.causal_softmax_bits(xp, p5, a).reshape(p.shape)
        fused.causal_softmax_(p5, a)
        return num.store_for_gemm(xp, p)
    p5 += _causal_bias(xp, a, b, p.dtype)
    p5 -= p5.max(axis=-1, keepdims=True)        # the diagonal is never masked: the max is finite
    xp.exp(p5, out=p5)
    s = _rowsum(xp, p5)
    xp.reciprocal(s, out=s)
    p5 *= s
    return num.store_for_gemm(xp, p)


def gqa_shapes(xp, q, k, v=None):
    """(B, H, T, hd, K, g) of q (B, H, T, hd) over k (B, K, T, hd), g query heads per key/value head, and
    the output y (B, T, H*dv), unfilled; dv: v's head width (B, K, T, dv), hd when v is not given."""
    B, H, T, hd = q.shape
    K = k.shape[1]
    if H % K:
        raise ValueError(f"{H} query heads do not split into groups of {K} key/value heads")
    dv = hd if v is None else v.shape[-1]
    return (B, H, T, hd, K, H // K), xp.empty((B, T, H * dv), dtype=q.dtype)


def gqa_attention_forward(xp, q, k, v, num=OFF, segments=None):
    # q: (B, H, T, hd), k: (B, K, T, hd), v: (B, K, T, dv) -> y: (B, T, H*dv); segments: (B, T) document ids
    # (None: one per row); dv may differ from hd (multi-head latent attention)
    (B, H, T, hd, K, g), y = gqa_shapes(xp, q, k, v)
    dv = v.shape[-1]
    if v.dtype == xp.uint16 and xp.__name__ == "cupy":
        v = xp.ascontiguousarray(v)         # bf16 bits (B, K, T, hd): one strided-batched GEMM over every head
    bits = num.writes_bits and y.dtype in (xp.float32, xp.uint16)
    if bits or y.dtype == xp.uint16:        # only the o projection and this cache read y: its bfloat16 bits
        y = xp.empty(y.shape, dtype=xp.uint16 if bits else xp.float32)
    y5 = _per_head(y, K, g)
    qs, ps = [], []
    with num.converted(xp, k, v):           # bf16: converted once for every block's products
        for a, b in _blocks(T):
            qb = _grouped(q, K, g, a, b)
            p = _softmax(xp, _mm(xp, qb, k[:, :, :b].swapaxes(-1, -2), num=num), a, num, segments)
            o = _mm(xp, p, v[:, :, :b], num=num).reshape(B, K, g, b - a, dv)
            if bits:
                to_bf16_bits(xp, o, out=y5[:, :, :, a:b])
            else:
                y5[:, :, :, a:b] = o
            qs.append(qb)
            ps.append(p)
    return num.store_for_gemm(xp, y), (qs, k, v, ps, y)


def gqa_drop_scores(cache):
    """The cache without its probabilities (selective recompute): the grouped queries, k, v and y stay."""
    qs, k, v, _, y = cache
    return qs, k, v, None, y


def gqa_restore_scores(xp, cache, num=OFF, segments=None):
    """A cache from gqa_drop_scores with its probabilities rebuilt from the cached queries and keys, bit
    for bit those of the forward (the same operations on the same arrays); a whole cache comes back as is."""
    qs, k, v, ps, y = cache
    if ps is not None:
        return cache
    ps = []
    for (a, b), qb in zip(_blocks(k.shape[2]), qs):
        ps.append(_softmax(xp, _mm(xp, qb, k[:, :, :b].swapaxes(-1, -2), num=num), a, num, segments))
    return qs, k, v, ps, y


def gqa_attention_backward(xp, dy, cache, num=OFF, segments=None):
    # dy: (B, T, H*dv) -> dq (B, H, T, hd), dk (B, K, T, hd), dv (B, K, T, dv); segments: unread (the cached
    # probabilities are exact zeros outside each query's document)
    qs, k, v, ps, y = cache
    B, K, T, hd = k.shape
    g = y.shape[-1] // (v.shape[-1] * K)
    dy5, y5 = _per_head(dy, K, g), _per_head(as_float32(xp, y), K, g)
    dq = xp.empty((B, K * g, T, hd), dtype=dy.dtype)
    dq5 = dq.reshape(B, K, g, T, hd)
    dk, dv = xp.empty(k.shape, dtype=dy.dtype), xp.empty(v.shape, dtype=dy.dtype)
    # the last block covers every key: it writes dk, dv whole, the earlier block adds to a prefix
    with num.converted(xp, dy, k, v):       # bf16: converted once for every block's products
        for (a, b), qb, p in reversed(list(zip(_blocks(T), qs, ps))):
            dob, ob = _grouped(dy5, K, g, a, b), _grouped(y5, K, g, a, b)
            # softmax backward: ds = p * (dp - rowsum(dp * p)), and rowsum(dp * p) = rowsum(do * o)
            rs = ((dob * ob).sum(axis=-1, keepdims=True) if dy.dtype.itemsize < 4
                  else xp.einsum("bkrd,bkrd->bkr", dob, ob)[..., None])
            ds = softmax_grad(xp, _mm(xp, dob, v[:, :, :b].swapaxes(-1, -2), num=num), p, rs,
                              fused.grouped_softmax_backward_, fused.grouped_softmax_backward_bits, num=num)
            with num.converted(xp, ds):
                dq5[:, :, :, a:b] = _mm(xp, ds, k[:, :, :b], num=num).reshape(B, K, g, b - a, hd)
                _mm(xp, p.swapaxes(-1, -2), dob, dv[:, :, :b], accumulate=b < T, num=num)
                _mm(xp, ds.swapaxes(-1, -2), qb, dk[:, :, :b], accumulate=b < T, num=num)
    return dq, dk, dv


def gqa_cache_elements(B: int, T: int, H: int, K: int, hd: int, score_elements: int) -> int:
    """Elements the forward caches for B sequences: the rotated queries and keys, the values (the
    projection's output), the output y and the probabilities of every query head."""
    return B * T * hd * (2 * H + 2 * K) + B * H * score_elements
