"""Causal multi-head self-attention on a fused, head-major qkv tensor: forward, backward, the score
blocks that skip the masked quarter, and dropping / restoring the cached scores (bf16-packed under amp).
Packed documents (segments): a query sees only the keys of its own document, the rest exactly zero.
"""
import math

from hpengine.device.bf16_bits import as_float32, to_bf16_bits
from hpengine.nn import fused, gemm
from hpengine.nn.numerics import OFF


# qkv's last axis reshapes to (n_heads, 3, hd) so a column split of the qkv
# projection hands each tensor-parallel rank whole heads. All heads and batch
# rows go through one batched matmul per query block. The scaled q is written
# contiguous (B, H, T, hd) by the scaling itself. On the CPU k, v, the output and
# the gradients are strided views of the fused arrays (the GEMMs take a leading
# dimension), except the keys of the forward's q k^T, copied once per pass into
# contiguous (B, H, hd, T): OpenBLAS runs those small per-head products about 1.7x
# faster than on the interleaved, transposed view, which more than pays for the
# copy. On CuPy every head operand is contiguous instead: every
# product is then one strided-batched cuBLAS call over all B*H heads (nn/gemm.py),
# where the interleaved views would take one call per batch row, each too small to
# fill a GPU. Query rows come in two blocks, the
# first attending only to the first half of the keys: a quarter of the scores
# (all masked) is never computed.
def _blocks(T):
    # query row ranges [a, b); block (a, b) attends to keys [0, b)
    h = T // 2
    return [(0, h), (h, T)] if h else [(0, T)]


def score_elements(T: int) -> int:
    """Attention probabilities kept per (sequence, head): each query block stores only the keys up to its
    end, so the fully masked corner is never stored."""
    return sum((b - a) * b for a, b in _blocks(T))


def attention_cache_elements(B: int, T: int, width: int, n_heads: int) -> int:
    """Elements the forward caches for B sequences of T tokens, `width` = n_heads x head_dim: qkv, the
    scaled q, the output y, and the probabilities of every head."""
    return B * T * 5 * width + B * n_heads * score_elements(T)


def _causal_bias(xp, a, b, dtype):
    # (b - a, b): 0 where key <= query (query rows a..b-1), -inf above, so exp() gives exact zeros
    return xp.triu(xp.full((b - a, b), -xp.inf, dtype=dtype), a + 1)


def same_document(xp, segments, a, b, c, d):
    """(B, 1, b-a, d-c) True where query a+i and key c+j lie in one document of their row (segments (B, T))."""
    return segments[:, None, a:b, None] == segments[:, None, None, c:d]


def _heads(a, n_heads, parts):
    # a: (B, T, H*parts*hd) -> `parts` views (B, H, T, hd) of it, no copy
    B, T, _ = a.shape
    v = a.reshape(B, T, n_heads, parts, -1)
    return [v[:, :, :, i].transpose(0, 2, 1, 3) for i in range(parts)]


def _mm(xp, a, b, out=None, accumulate=False, num=OFF):
    # a @ b, into out or added to it; on CuPy through strided cuBLAS calls that copy no operand; bf16
    # operands under bf16 amp (num.bf16: bf16_gemm.py)
    if num.bf16:
        return num.matmul(xp, a, b, out, accumulate)
    if _on_gpu(xp):
        return gemm.matmul(xp, a, b, out, accumulate)
    if accumulate:
        out += a @ b
        return out
    return xp.matmul(a, b) if out is None else xp.matmul(a, b, out=out)


def _on_gpu(xp) -> bool:
    return fused.ENABLED and xp.__name__ == "cupy"


def _rowsum(xp, a):
    # sum over the last axis as a GEMV with a ones vector: several times faster than a.sum(-1)
    return xp.matmul(a, xp.ones(a.shape[-1], dtype=a.dtype))[..., None]


# Under bf16 amp the probabilities are stored as the GEMMs read them (num.store_for_gemm): packed, as
# bfloat16 bits, which the softmax kernel writes from the float32 scores; the forward's product with the values,
# the cache, the softmax gradient and dv's product read those bits.
def attention_forward(xp, qkv, n_heads, num=OFF, segments=None):
    # qkv: (B, T, H*3*hd) head-major -> y: (B, T, H*hd); segments: (B, T) document ids (None: one per row)
    B, T, C3 = qkv.shape
    if C3 % (3 * n_heads):
        raise ValueError(f"qkv last dim {C3} is not a multiple of 3 * n_heads = {3 * n_heads}")
    hd = C3 // (3 * n_heads)
    q, k, v = _heads(qkv, n_heads, 3)
    # Scaling q (T*hd) is cheaper than scaling the scores (T*T) when T > hd; it also
    # leaves the caller's qkv untouched, and writes q contiguous.
    q = xp.multiply(q, 1.0 / math.sqrt(hd), out=xp.empty((B, n_heads, T, hd), dtype=qkv.dtype))
    gpu = _on_gpu(xp)
    kt = _transposed(xp, k)
    if gpu:
        v = xp.ascontiguousarray(v)
        o = xp.empty((B, n_heads, T, hd), dtype=q.dtype)
    else:
        y = xp.empty((B, T, n_heads * hd), dtype=q.dtype)
        (o,) = _heads(y, n_heads, 1)
    ps = []
    with num.converted(xp, q, kt if kt.flags.c_contiguous else kt.base, v):   # bf16: converted once, not per block
        for a, b in _blocks(T):
            p = _scores(xp, q, kt, a, b, num, segments)
            _mm(xp, p, v[:, :, :b], o[:, :, a:b], num=num)
            ps.append(p)
    if gpu and num.writes_bits:                 # only the projection and this cache read y: its bfloat16 bits
        y = to_bf16_bits(xp, o.transpose(0, 2, 1, 3)).reshape(B, T, n_heads * hd)
    elif gpu:
        y = o.transpose(0, 2, 1, 3).reshape(B, T, n_heads * hd)     # one copy back to (B, T, H*hd)
    y = num.store_for_gemm(xp, y)
    return y, (qkv, q, ps, y)


def _transposed(xp, a):
    # heads (B, H, T, hd) as a product reads them transposed, (B, H, hd, T): copied contiguous in that order
    # on the CPU (through a contiguous copy first: the transpose of contiguous heads is 1.7x faster than one
    # out of the interleaved qkv rows); on CuPy the transposed view of contiguous heads (cuBLAS transposes
    # inside the call)
    a = xp.ascontiguousarray(a)
    return a.swapaxes(-1, -2) if _on_gpu(xp) else xp.ascontiguousarray(a.swapaxes(-1, -2))


def _scores(xp, q, kt, a, b, num, segments=None):
    # the probabilities of query rows a..b-1 over keys 0..b-1 (kt: the keys _transposed): the forward's exact operations
    p = _mm(xp, q[:, :, a:b], kt[..., :b], num=num)
    if segments is not None:
        # -inf outside the query's document: exp gives exact zeros, so another document changes no bit here
        p = xp.where(same_document(xp, segments, a, b, 0, b), p, -xp.inf)
    if segments is None and fused.usable(xp, p) and p.flags.c_contiguous:
        if num.writes_bits and p.dtype == xp.float32:
            return fused.causal_softmax_bits(xp, p, a)     # the probabilities' bfloat16 bits from the scores
        fused.causal_softmax_(p, a)         # mask, max, exp, sum and scale in one pass
    else:
        p += _causal_bias(xp, a, b, p.dtype)
        # Row max is finite (the diagonal is never masked), so this is stable.
        p -= p.max(axis=-1, keepdims=True)
        xp.exp(p, out=p)
        s = _rowsum(xp, p)
        xp.reciprocal(s, out=s)
        p *= s
    return num.store_for_gemm(xp, p)


def softmax_grad(xp, ds, p, rs, fuse, fuse_bits, rs_rows=None, num=OFF):
    """(ds - rs) * p (ds: dP on entry, float32 or float64; p the probabilities as stored: bfloat16 bits under bf16
    amp, packed) as the two GEMMs after it take it: bits from the kernel (a new array; fuse_bits(ds, p, rs)),
    else in ds's place (fuse(ds, p, rs) when the arrays suit the kernel; rs_rows: the rows of rs the NumPy form
    subtracts, default rs) and stored by num.store_for_gemm."""
    if fused.usable(xp, ds, rs) and p.dtype in (ds.dtype, xp.uint16) and ds.flags.c_contiguous and \
            p.flags.c_contiguous:
        if num.writes_bits and p.dtype == xp.uint16:
            return fuse_bits(ds, p, rs)
        fuse(ds, p, rs)
        return num.store_for_gemm(xp, ds)
    ds -= rs if rs_rows is None else rs_rows
    ds *= as_float32(xp, p)
    return num.store_for_gemm(xp, ds)


def attention_drop_scores(cache):
    """The cache without its probabilities (selective recompute): qkv, the scaled q and the output stay."""
    qkv, q, _, y = cache
    return qkv, q, None, y


def attention_restore_scores(xp, cache, num=OFF, segments=None):
    """A cache from attention_drop_scores with its probabilities rebuilt from the cached q and k, bit for
    bit those of the forward (the same operations on the same arrays); a whole cache comes back as is."""
    qkv, q, ps, y = cache
    if ps is not None:
        return cache
    kt = _transposed(xp, _heads(qkv, q.shape[1], 3)[1])      # the forward's copy of the keys
    return qkv, q, [_scores(xp, q, kt, a, b, num, segments) for a, b in _blocks(qkv.shape[1])], y


def attention_backward(xp, dy, cache, num=OFF, segments=None):
    # dy: (B, T, H*hd) -> dqkv: (B, T, H*3*hd) head-major; segments: unread (the cached probabilities are exact
    # zeros outside each query's document, so the gradients are too)
    qkv, q, ps, y = cache  # q is already scaled
    B, T, C3 = qkv.shape
    H = q.shape[1]
    _, k, v = _heads(qkv, H, 3)
    (do,), (o,) = _heads(dy, H, 1), _heads(as_float32(xp, y), H, 1)
    dqkv = xp.empty((B, T, C3), dtype=dy.dtype)
    gpu = _on_gpu(xp)
    # the values as ds = do @ v^T reads them: a view on the CPU (a transposed copy costs there what it saves),
    # contiguous heads on CuPy, as every operand there (see the comment above _blocks)
    vt = _transposed(xp, v) if gpu else v.swapaxes(-1, -2)
    dq, dk, dv = _heads(dqkv, H, 3)
    if gpu:
        k, do = xp.ascontiguousarray(k), xp.ascontiguousarray(do)
        dq, dk, dv = (xp.empty(do.shape, dtype=dy.dtype) for _ in range(3))
    dob_all = do
    # softmax backward: ds = p * (dp - rowsum(dp * p)); rowsum(dp * p) equals
    # rowsum(do * o), which costs T*hd instead of T*T per row block.
    if dy.dtype.itemsize < 4:  # half (amp): NumPy's sum accumulates in float32
        rs = (do * o).sum(axis=-1, keepdims=True)
    else:
        rs = xp.ascontiguousarray(xp.einsum("bhtd,bhtd->bht", do, o)[..., None])
    # the last block covers every key: it writes dk, dv whole, earlier blocks add to a prefix
    keys = vt if vt.flags.c_contiguous else vt.base
    with num.converted(xp, dob_all, keys, k, q):          # bf16: each converted once for every block's products
        for (a, b), p in reversed(list(zip(_blocks(T), ps))):
            dob = dob_all[:, :, a:b]
            ds = softmax_grad(xp, _mm(xp, dob, vt[..., :b], num=num), p, rs,
                              lambda d, p_, r: fused.softmax_backward_(d, p_, r, a),
                              lambda d, p_, r: fused.softmax_backward_bits(d, p_, r, a), rs[:, :, a:b], num)
            with num.converted(xp, ds):
                _mm(xp, ds, k[:, :, :b], dq[:, :, a:b], num=num)
                _mm(xp, p.swapaxes(-1, -2), dob, dv[:, :, :b], accumulate=b < T, num=num)
                _mm(xp, ds.swapaxes(-1, -2), q[:, :, a:b], dk[:, :, :b], accumulate=b < T, num=num)
    dq *= 1.0 / math.sqrt(C3 // (3 * H))
    if gpu:
        for dst, src in zip(_heads(dqkv, H, 3), (dq, dk, dv)):
            dst[...] = src
    return dqkv
