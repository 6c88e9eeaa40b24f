"""The outer exchange's formats (DiLoCo's quantize): int8 or int4 per block of BLOCK values with one float32
scale each (max |x| / 127 or / 7, round half to even, packed two int4 per byte as value + 8), as one byte
payload per island; dequantising every island's payload and their mean. Runs on NumPy or CuPy arrays.
"""
from __future__ import annotations

import numpy as np

BLOCK = 128
LEVELS = {"int8": 127, "int4": 7}


def payload_bytes(n: int, fmt: str) -> int:
    """Bytes of one island's payload for n values: the codes, then the blocks' float32 scales."""
    blocks = -(-n // BLOCK)
    codes = blocks * BLOCK if fmt == "int8" else blocks * BLOCK // 2
    return codes + 4 * blocks


def encode(xp, v, fmt: str):
    """(payload: uint8 array of payload_bytes(v.size), the dequantised values v as the others will read them)."""
    levels, n = LEVELS[fmt], v.size
    blocks = -(-n // BLOCK)
    x = xp.zeros(blocks * BLOCK, dtype=v.dtype)
    x[:n] = v
    x = x.reshape(blocks, BLOCK)
    scale = (xp.abs(x).max(axis=1) / levels).astype(np.float32)
    safe = xp.where(scale > 0, scale, np.float32(1)).astype(v.dtype)[:, None]
    q = xp.clip(xp.rint(x / safe), -levels, levels).astype(np.int8)
    seen = (q.astype(v.dtype) * scale.astype(v.dtype)[:, None]).reshape(-1)[:n]
    if fmt == "int8":
        codes = q.view(np.uint8).reshape(-1)
    else:
        u = (q + 8).astype(np.uint8).reshape(-1)
        codes = u[0::2] | (u[1::2] << np.uint8(4))
    return xp.concatenate([codes, scale.view(np.uint8)]), seen


def decode(xp, payload, n: int, fmt: str, dtype):
    """The n values one island's payload stands for, in dtype."""
    blocks = -(-n // BLOCK)
    ncode = payload_bytes(n, fmt) - 4 * blocks
    codes, scale = payload[:ncode], payload[ncode:].view(np.float32)
    if fmt == "int8":
        q = codes.view(np.int8).astype(dtype)
    else:
        q = xp.empty(2 * codes.size, dtype=dtype)
        q[0::2] = (codes & np.uint8(15)).astype(dtype) - 8
        q[1::2] = (codes >> np.uint8(4)).astype(dtype) - 8
    return (q.reshape(blocks, BLOCK) * scale.astype(dtype)[:, None]).reshape(-1)[:n]


def mean_of(xp, gathered, islands: int, n: int, fmt: str, dtype):
    """The mean over the islands of their dequantised payloads (gathered: each island's in island order),
    summed in island order so every rank gets the same bits."""
    size = payload_bytes(n, fmt)
    total = decode(xp, gathered[:size], n, fmt, dtype)
    for i in range(1, islands):
        total += decode(xp, gathered[i * size:(i + 1) * size], n, fmt, dtype)
    return total / np.dtype(dtype).type(islands)
