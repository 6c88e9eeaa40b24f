"""What the models share for incremental decoding (`hpengine generate`): per-layer key/value caches, the
attention of new query positions over the cached keys, and the head's logits without a loss.
"""
from __future__ import annotations

from hpengine.models.common import head_weight
from hpengine.nn import linear_forward


# Every model offers the same four methods, so the generator never branches on the model kind:
#   decode_cache(xp, dtype)                 one entry per layer (None where a layer mixes no positions)
#   decode_embed(xp, P, ids, start)         ids (1, n) at positions start .. start+n-1 -> x (1, n, C)
#   decode_layer(xp, P, i, x, cache, start) layer i over the new positions, appending their keys/values
#   head_logits(xp, P, x)                   final norm and output projection -> (..., vocab_size)
class KVCache:
    """Keys and values of one layer: (heads, seq_len, head_dim) each; rows 0 .. start+n-1 are filled."""

    def __init__(self, xp, heads: int, T: int, hd: int, dtype):
        self.k = xp.zeros((heads, T, hd), dtype)
        self.v = xp.zeros((heads, T, hd), dtype)

    def attend(self, xp, q, k, v, start: int):
        """Store k, v (heads, n, hd) at rows start..; causal attention of q (heads, g, n, hd), already
        scaled, over rows 0 .. start+n-1, query position start+j seeing keys up to start+j.
        Returns (heads, g, n, hd): the g query heads of a group share their key/value head."""
        n = k.shape[1]
        L = start + n
        self.k[:, start:L] = k
        self.v[:, start:L] = v
        K, g = q.shape[:2]
        s = (q.reshape(K, g * n, -1) @ self.k[:, :L].swapaxes(-1, -2)).reshape(K, g, n, L)
        if n > 1:               # a single new position sees every cached key: nothing to mask
            s = xp.where(xp.arange(L)[None, :] > xp.arange(start, L)[:, None], -xp.inf, s)
        s -= s.max(axis=-1, keepdims=True)
        xp.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        return (s.reshape(K, g * n, L) @ self.v[:, :L]).reshape(K, g, n, -1)


def output_logits(xp, P, h, tied: bool, V: int):
    """The output projection of the normed h (..., C): logits over the true vocabulary (padding dropped)."""
    w, _ = head_weight(P, None, tied)
    logits, _ = linear_forward(xp, h, w)
    return logits[..., :V]
