"""The outer exchange's formats (DiLoCo's quantize): int8 or int4 per block of BLOCK values with one float32
scale each (max |x| / 127 or / 7, round half to even, packed two int4 per byte as value + 8), the blocks laid from
the start of each segment (a tensor's piece), as one byte payload per island; dequantising every island's payload
and their mean. Runs on NumPy or CuPy arrays.
"""
from __future__ import annotations

import numpy as np

BLOCK = 128
LEVELS = {"int8": 127, "int4": 7}


def blocks_of(segments) -> int:
    """Blocks of the segments (lengths), each padded to whole blocks."""
    return sum(-(-n // BLOCK) for n in segments)


def payload_bytes(segments, fmt: str) -> int:
    """Bytes of one island's payload for values in segments (lengths): the codes, then the blocks' float32 scales."""
    blocks = blocks_of(segments)
    codes = blocks * BLOCK if fmt == "int8" else blocks * BLOCK // 2
    return codes + 4 * blocks


def _padded(xp, v, segments):
    """v laid out with each segment from a block boundary, zeros between: (blocks, BLOCK)."""
    x = xp.zeros(blocks_of(segments) * BLOCK, dtype=v.dtype)
    at = pos = 0
    for n in segments:
        x[pos:pos + n] = v[at:at + n]
        at, pos = at + n, pos + -(-n // BLOCK) * BLOCK
    return x.reshape(-1, BLOCK)


def _unpadded(xp, x, segments, dtype):
    """The segments' values back out of the padded (blocks, BLOCK) array."""
    flat, out = x.reshape(-1), xp.empty(sum(segments), dtype=dtype)
    at = pos = 0
    for n in segments:
        out[at:at + n] = flat[pos:pos + n]
        at, pos = at + n, pos + -(-n // BLOCK) * BLOCK
    return out


def encode(xp, v, fmt: str, segments=None):
    """(payload: uint8 array of payload_bytes(segments), the dequantised values v as the others will read them);
    segments: the lengths of v's pieces, each starting a block (None: v whole)."""
    segments = [v.size] if segments is None else segments
    levels = LEVELS[fmt]
    x = _padded(xp, v, segments)
    scale = (xp.abs(x).max(axis=1) / levels).astype(np.float32)
    safe = xp.where(scale > 0, scale, np.float32(1)).astype(v.dtype)[:, None]
    q = xp.clip(xp.rint(x / safe), -levels, levels).astype(np.int8)
    seen = _unpadded(xp, q.astype(v.dtype) * scale.astype(v.dtype)[:, None], segments, v.dtype)
    if fmt == "int8":
        codes = q.view(np.uint8).reshape(-1)
    else:
        u = (q + 8).astype(np.uint8).reshape(-1)
        codes = u[0::2] | (u[1::2] << np.uint8(4))
    return xp.concatenate([codes, scale.view(np.uint8)]), seen


def decode(xp, payload, segments, fmt: str, dtype):
    """The values one island's payload stands for, in dtype."""
    blocks = blocks_of(segments)
    ncode = payload_bytes(segments, fmt) - 4 * blocks
    codes, scale = payload[:ncode], payload[ncode:].view(np.float32)
    if fmt == "int8":
        q = codes.view(np.int8).astype(dtype)
    else:
        q = xp.empty(2 * codes.size, dtype=dtype)
        q[0::2] = (codes & np.uint8(15)).astype(dtype) - 8
        q[1::2] = (codes >> np.uint8(4)).astype(dtype) - 8
    return _unpadded(xp, q.reshape(blocks, BLOCK) * scale.astype(dtype)[:, None], segments, dtype)


def mean_of(xp, gathered, islands: int, segments, fmt: str, dtype):
    """The mean over the islands of their dequantised payloads (gathered: each island's in island order),
    summed in island order so every rank gets the same bits."""
    size = payload_bytes(segments, fmt)
    total = decode(xp, gathered[:size], segments, fmt, dtype)
    for i in range(1, islands):
        total += decode(xp, gathered[i * size:(i + 1) * size], segments, fmt, dtype)
    return total / np.dtype(dtype).type(islands)
