"""Token-embedding lookup and its scatter-add gradient.

`vocab_start` lets a rank hold rows [vocab_start, vocab_start + V_local) of a
vocab-parallel table: ids outside that range read zero rows and get no gradient.
"""
from hpengine.device import backend


def embedding_forward(xp, idx, w, vocab_start=0):
    # idx: (B, T) int, w: (V_local, C) -> y: (B, T, C)
    local = idx - vocab_start
    valid = (local >= 0) & (local < w.shape[0])
    # Out-of-range ids are clamped to row 0 for the gather and then zeroed,
    # which avoids a boolean compress (a device sync on CuPy).
    safe = xp.where(valid, local, 0)
    y = xp.take(w, safe, axis=0)
    y *= valid[..., None]
    return y, (safe, valid)


def embedding_backward(xp, dy, cache, dw):
    # dy: (B, T, C), dw: (V_local, C); repeated ids are summed
    safe, valid = cache
    C = dw.shape[1]
    ids = safe.reshape(-1)
    dy2 = dy.reshape(-1, C)
    valid = valid.reshape(-1)
    if xp.__name__ == "cupy":   # GPU atomics make a direct scatter-add the fast path
        backend.scatter_add(dw, ids, dy2 * valid[:, None])
        return None
    if not valid.all():
        ids, dy2 = ids[valid], dy2[valid]
    if not dw.flags.c_contiguous:
        xp.add.at(dw, ids, dy2)
        return None
    # NumPy's 1-D ufunc.at fast path on flat element indices is ~6x faster than
    # row-wise add.at and ~3x faster than sort + add.reduceat, whatever the repeats.
    flat = ids[:, None] * C + xp.arange(C)
    xp.add.at(dw.reshape(-1), flat.reshape(-1), dy2.reshape(-1))
    return None


def embedding_backward_input(xp, dy, cache):
    # dy: (B, T, C) -> None: token ids have no gradient
    """The input half (B) of a split embedding backward: nothing, as the lookup's input is token ids."""
    return None


def embedding_backward_weight(xp, dy, cache, dw):
    # dy: (B, T, C), dw: (V_local, C) -> None
    """The weight half (W): all of embedding_backward, the scatter-add into dw. Deferred, it needs dy as
    backward was handed it: the caller keeps dy unmodified until W runs."""
    return embedding_backward(xp, dy, cache, dw)


def embedding_cache_bytes(n: int) -> int:
    """Bytes the forward caches for n token ids: an int64 index and a bool mask each."""
    return n * (8 + 1)
