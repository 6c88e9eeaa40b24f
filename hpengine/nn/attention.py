"""Causal multi-head self-attention on a fused, head-major qkv tensor.

qkv's last axis reshapes to (n_heads, 3, hd) so a column split of the qkv
projection hands each tensor-parallel rank whole heads. All heads and batch
rows go through one batched matmul.
"""
import math


def _causal_bias(xp, T, dtype):
    # (T, T): 0 on and below the diagonal, -inf above, so exp() gives exact zeros
    bias = xp.zeros((T, T), dtype=dtype)
    bias[xp.triu(xp.ones((T, T), dtype=bool), 1)] = -xp.inf
    return bias


def attention_forward(xp, qkv, n_heads):
    # qkv: (B, T, H*3*hd) head-major -> y: (B, T, H*hd)
    B, T, C3 = qkv.shape
    if C3 % (3 * n_heads):
        raise ValueError(f"qkv last dim {C3} is not a multiple of 3 * n_heads = {3 * n_heads}")
    hd = C3 // (3 * n_heads)
    # One copy into (3, B, H, T, hd): contiguous q, k, v for the GEMMs.
    qkvt = qkv.reshape(B, T, n_heads, 3, hd).transpose(3, 0, 2, 1, 4).copy()
    q, k, v = qkvt[0], qkvt[1], qkvt[2]
    # Scaling q (T*hd) is cheaper than scaling the scores (T*T) when T > hd.
    q *= 1.0 / math.sqrt(hd)
    p = q @ k.swapaxes(-1, -2)
    p += _causal_bias(xp, T, p.dtype)
    # Row max is finite (the diagonal is never masked), so this is stable.
    p -= p.max(axis=-1, keepdims=True)
    xp.exp(p, out=p)
    s = p.sum(axis=-1, keepdims=True)
    xp.reciprocal(s, out=s)
    p *= s
    o = p @ v
    y = o.transpose(0, 2, 1, 3).reshape(B, T, n_heads * hd)
    return y, (qkvt, p, o)


def attention_backward(xp, dy, cache):
    # dy: (B, T, H*hd) -> dqkv: (B, T, H*3*hd) head-major
    qkvt, p, o = cache
    _, B, H, T, hd = qkvt.shape
    q, k, v = qkvt[0], qkvt[1], qkvt[2]  # q is already scaled
    do = dy.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
    dqkv = xp.empty((B, T, H, 3, hd), dtype=dy.dtype)
    dqkv[:, :, :, 2] = (p.swapaxes(-1, -2) @ do).transpose(0, 2, 1, 3)
    ds = do @ v.swapaxes(-1, -2)
    # softmax backward: ds = p * (dp - rowsum(dp * p)); rowsum(dp * p) equals
    # rowsum(do * o), which costs T*hd instead of T*T per row block.
    ds -= (do * o).sum(axis=-1, keepdims=True)
    ds *= p
    dq = ds @ k
    dq *= 1.0 / math.sqrt(hd)
    dqkv[:, :, :, 0] = dq.transpose(0, 2, 1, 3)
    dqkv[:, :, :, 1] = (ds.swapaxes(-1, -2) @ q).transpose(0, 2, 1, 3)
    return dqkv.reshape(B, T, H * 3 * hd)
