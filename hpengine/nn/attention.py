"""Causal multi-head self-attention on a fused, head-major qkv tensor.

qkv's last axis reshapes to (n_heads, 3, hd) so a column split of the qkv
projection hands each tensor-parallel rank whole heads. All heads and batch
rows go through one batched matmul. q, k, v and the head merge/split are
strided views (the GEMMs take a leading dimension), so nothing is copied into
head-major order and back.
"""
import math


def _causal_bias(xp, T, dtype):
    # (T, T): 0 on and below the diagonal, -inf above, so exp() gives exact zeros
    return xp.triu(xp.full((T, T), -xp.inf, dtype=dtype), 1)


def _heads(a, n_heads, parts):
    # a: (B, T, H*parts*hd) -> `parts` views (B, H, T, hd) of it, no copy
    B, T, _ = a.shape
    v = a.reshape(B, T, n_heads, parts, -1)
    return [v[:, :, :, i].transpose(0, 2, 1, 3) for i in range(parts)]


def _rowsum(xp, a):
    # sum over the last axis as a GEMV with a ones vector: several times faster than a.sum(-1)
    return xp.matmul(a, xp.ones(a.shape[-1], dtype=a.dtype))[..., None]


def attention_forward(xp, qkv, n_heads):
    # qkv: (B, T, H*3*hd) head-major -> y: (B, T, H*hd)
    B, T, C3 = qkv.shape
    if C3 % (3 * n_heads):
        raise ValueError(f"qkv last dim {C3} is not a multiple of 3 * n_heads = {3 * n_heads}")
    hd = C3 // (3 * n_heads)
    q, k, v = _heads(qkv, n_heads, 3)
    # Scaling q (T*hd) is cheaper than scaling the scores (T*T) when T > hd; it also
    # leaves the caller's qkv untouched.
    q = q * (1.0 / math.sqrt(hd))
    p = q @ k.swapaxes(-1, -2)
    p += _causal_bias(xp, T, p.dtype)
    # Row max is finite (the diagonal is never masked), so this is stable.
    p -= p.max(axis=-1, keepdims=True)
    xp.exp(p, out=p)
    s = _rowsum(xp, p)
    xp.reciprocal(s, out=s)
    p *= s
    y = xp.empty((B, T, n_heads * hd), dtype=p.dtype)
    xp.matmul(p, v, out=_heads(y, n_heads, 1)[0])
    return y, (qkv, q, p, y)


def attention_backward(xp, dy, cache):
    # dy: (B, T, H*hd) -> dqkv: (B, T, H*3*hd) head-major
    qkv, q, p, y = cache  # q is already scaled
    B, T, C3 = qkv.shape
    H = p.shape[1]
    _, k, v = _heads(qkv, H, 3)
    (do,), (o,) = _heads(dy, H, 1), _heads(y, H, 1)
    dqkv = xp.empty((B, T, C3), dtype=dy.dtype)
    dq, dk, dv = _heads(dqkv, H, 3)
    xp.matmul(p.swapaxes(-1, -2), do, out=dv)
    ds = do @ v.swapaxes(-1, -2)
    # softmax backward: ds = p * (dp - rowsum(dp * p)); rowsum(dp * p) equals
    # rowsum(do * o), which costs T*hd instead of T*T per row block.
    ds -= xp.einsum("bhtd,bhtd->bht", do, o)[..., None]
    ds *= p
    xp.matmul(ds, k, out=dq)
    dq *= 1.0 / math.sqrt(C3 // (3 * H))
    xp.matmul(ds.swapaxes(-1, -2), q, out=dk)
    return dqkv
