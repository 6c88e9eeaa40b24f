"""The largest causal attention logit of each query head over a batch (what MuonClip clips): the scaled q . k
that enters the softmax, over every batch row and every (query, key) pair the mask keeps (causal, and with packed
documents the same document). Pure; it reads the q and k an attention core is handed and changes nothing.
"""
import math

from hpengine.device.bf16_bits import as_float32
from hpengine.nn.attention import _heads

ROWS = 128       # query positions per tile: the tile's scores are (B, H, ROWS, T), never the whole T x T


def causal_max_logits(xp, q, k, segments=None):
    # q: (B, H, T, hd) already scaled as the attention scales it, k: (B, K, T, hd), H = K g (query head h reads
    # key head h // g) -> (H,) each head's largest q_t . k_s over s <= t and every row; bfloat16 bits are read as
    # their float32 values. segments (B, T) device ints: each token's document in its row (packed documents), a
    # pair of two documents is masked as the attention masks it
    B, H, T, hd = q.shape
    K = k.shape[1]
    q5 = as_float32(xp, q).reshape(B, K, H // K, T, hd)
    kt = as_float32(xp, k).swapaxes(-1, -2)[:, :, None]           # (B, K, 1, hd, T)
    best = None
    for a in range(0, T, ROWS):
        b = min(a + ROWS, T)
        s = q5[:, :, :, a:b] @ kt[..., :b]                         # (B, K, g, b - a, b)
        # key s is masked for query t when s > t: those scores never enter the softmax
        masked = xp.arange(b)[None, :] > xp.arange(a, b)[:, None]
        if segments is not None:        # (B, 1, 1, b - a, b): also where query and key lie in other documents
            masked = (masked | (segments[:, a:b, None] != segments[:, None, :b]))[:, None, None]
        s = xp.where(masked, -xp.inf, s)
        m = s.max(axis=(0, 3, 4))
        best = m if best is None else xp.maximum(best, m)
    return best.reshape(H)


def fused_max_logits(xp, qkv, n_heads: int, segments=None):
    # qkv: (B, T, H*3*hd) head-major, as nn/attention.py reads it -> (H,); q scaled by 1/sqrt(hd) as the
    # forward scales it (before the product), so the logits are the softmax's own operands; segments as above
    q, k, _ = _heads(as_float32(xp, qkv), n_heads, 3)
    return causal_max_logits(xp, q * (1.0 / math.sqrt(q.shape[-1])), k, segments)
