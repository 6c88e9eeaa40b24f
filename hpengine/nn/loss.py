"""Softmax cross-entropy over the last dim, normalised by a caller-given count.

`norm` is the global token count of the optimizer step, so partial losses from
ranks (or micro-batches) that each see part of the batch sum to the global mean.
"""
from hpengine.nn import fused


def cross_entropy_forward(xp, logits, targets, norm, mask=None):
    # logits: (B, T, V), targets: (B, T) int -> loss: 0-d, logits dtype; mask: (B, T), 0 where a target does not
    # count (its loss and gradient exactly zero), None: every one counts
    if fused.usable(xp, logits):
        p, nll = fused.cross_entropy_forward(xp, logits, targets)
        return masked(xp, nll, mask).sum() * (1.0 / float(norm)), (p, targets, float(norm), *masks(mask))
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
    loss = masked(xp, nll, mask).sum() * (1.0 / float(norm))
    return loss, (p, targets, float(norm), *masks(mask))


def masks(mask) -> tuple:
    """What a cross-entropy cache keeps of a loss mask: nothing when every target counts."""
    return () if mask is None else (mask,)


def masked(xp, a, mask):
    """a (B, T, ...) with the rows of uncounted targets exactly zero (a itself when mask is None)."""
    if mask is None:
        return a
    keep = (mask != 0).reshape(mask.shape + (1,) * (a.ndim - mask.ndim))
    return xp.where(keep, a, 0)


def cross_entropy_backward(xp, cache, dloss=1.0):
    # -> dlogits: (B, T, V) = (softmax - onehot) * dloss / norm
    p, targets, norm, *mask = cache
    scale = float(dloss) / norm
    if fused.usable(xp, p):
        d = fused.cross_entropy_backward(xp, p, targets, scale)
        return masked(xp, d, mask[0]) if mask else d
    V = p.shape[-1]
    d = p * scale
    d2 = d.reshape(-1, V)
    d2[xp.arange(d2.shape[0]), targets.reshape(-1)] -= scale
    return masked(xp, d, mask[0]) if mask else d
