"""Softmax cross-entropy over the last dim, normalised by a caller-given count.

`norm` is the global token count of the optimizer step, so partial losses from
ranks (or micro-batches) that each see part of the batch sum to the global mean.
"""
from hpengine.nn import fused


def cross_entropy_forward(xp, logits, targets, norm):
    # logits: (B, T, V), targets: (B, T) int -> loss: 0-d, logits dtype
    if fused.usable(xp, logits):
        p, nll = fused.cross_entropy_forward(xp, logits, targets)
        return nll.sum() * (1.0 / float(norm)), (p, targets, float(norm))
    m = logits.max(axis=-1, keepdims=True)
    zt = xp.take_along_axis(logits, targets[..., None], axis=-1)
    zt -= m
    p = logits - m
    xp.exp(p, out=p)
    s = p.sum(axis=-1, keepdims=True)
    # nll = log(sum exp(z - m)) - (z_target - m)
    nll = xp.log(s)
    nll -= zt
    xp.reciprocal(s, out=s)
    p *= s
    loss = nll.sum() * (1.0 / float(norm))
    return loss, (p, targets, float(norm))


def cross_entropy_backward(xp, cache, dloss=1.0):
    # -> dlogits: (B, T, V) = (softmax - onehot) * dloss / norm
    p, targets, norm = cache
    scale = float(dloss) / norm
    if fused.usable(xp, p):
        return fused.cross_entropy_backward(xp, p, targets, scale)
    V = p.shape[-1]
    d = p * scale
    d2 = d.reshape(-1, V)
    d2[xp.arange(d2.shape[0]), targets.reshape(-1)] -= scale
    return d
