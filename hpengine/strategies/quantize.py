"""The outer exchange's formats (DiLoCo's quantize): int8 or int4 per block of BLOCK values with one float32
scale each (max |x| / 127 or / 7, round half to even, packed two int4 per byte as value + 8), the blocks laid from
the start of each segment (a tensor's piece) and cut into one chunk of whole blocks per island; a chunk's payload is
its codes then its scales. Encoding, decoding, and an owner's mean of every island's copy of its chunk, re-encoded.
"""
from __future__ import annotations

import numpy as np

BLOCK = 256         # 4 bytes of scale per 256 values: 1.6 % on int8, 3.1 % on int4
LEVELS = {"int8": 127, "int4": 7}


def blocks_of(segments) -> int:
    """Blocks of the segments (lengths), each padded to whole blocks."""
    return sum(-(-n // BLOCK) for n in segments)


def chunks(blocks: int, islands: int) -> list[tuple[int, int]]:
    """Island j's chunk: blocks [blocks j / M, blocks (j + 1) / M) (rounded down), as equal as whole blocks allow."""
    return [(blocks * j // islands, blocks * (j + 1) // islands) for j in range(islands)]


def chunk_bytes(blocks: int, fmt: str) -> int:
    """Bytes of the payload of `blocks` blocks: the codes, then their float32 scales."""
    return (blocks * BLOCK if fmt == "int8" else blocks * BLOCK // 2) + 4 * blocks


def payload_bytes(segments, fmt: str) -> int:
    """Bytes of one island's payload for values in segments (lengths): every chunk's, in island order."""
    return chunk_bytes(blocks_of(segments), fmt)


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


def _encode_blocks(xp, x, fmt: str):
    """(codes: uint8, scales: float32, the dequantised blocks) of x (blocks, BLOCK)."""
    levels = LEVELS[fmt]
    scale = (xp.abs(x).max(axis=1) / levels).astype(np.float32)
    safe = xp.where(scale > 0, scale, np.float32(1)).astype(x.dtype)[:, None]
    q = xp.clip(xp.rint(x / safe), -levels, levels).astype(np.int8)
    seen = q.astype(x.dtype) * scale.astype(x.dtype)[:, None]
    if fmt == "int8":
        codes = q.view(np.uint8).reshape(-1)
    else:
        u = (q + 8).astype(np.uint8).reshape(-1)
        codes = u[0::2] | (u[1::2] << np.uint8(4))
    return codes, scale, seen


def _payloads(xp, x, fmt: str, islands: int):
    """x (blocks, BLOCK) as the chunks' payloads one after another, and the dequantised blocks."""
    codes, scale, seen = _encode_blocks(xp, x, fmt)
    per = BLOCK if fmt == "int8" else BLOCK // 2
    parts = []
    for a, b in chunks(x.shape[0], islands):
        parts += [codes[a * per:b * per], scale[a:b].view(np.uint8)]
    return xp.concatenate(parts), seen


def _decode_blocks(xp, payload, blocks: int, fmt: str, dtype):
    """The (blocks, BLOCK) values a payload of `blocks` blocks stands for, in dtype."""
    ncode = chunk_bytes(blocks, fmt) - 4 * blocks
    codes, scale = payload[:ncode], payload[ncode:].view(np.float32)
    if fmt == "int8":
        q = codes.view(np.int8).astype(dtype)
    else:
        q = xp.empty(2 * codes.size, dtype=dtype)
        q[0::2] = (codes & np.uint8(15)).astype(dtype) - 8
        q[1::2] = (codes >> np.uint8(4)).astype(dtype) - 8
    return q.reshape(blocks, BLOCK) * scale.astype(dtype)[:, None]


def encode(xp, v, fmt: str, segments, islands: int):
    """(payload: uint8, every chunk's in island order; the dequantised values v as the others will read them;
    the chunks' byte counts); segments: the lengths of v's pieces, each starting a block."""
    x = _padded(xp, v, segments)
    payload, seen = _payloads(xp, x, fmt, islands)
    counts = [chunk_bytes(b - a, fmt) for a, b in chunks(x.shape[0], islands)]
    return payload, _unpadded(xp, seen, segments, v.dtype), counts


def mean_chunk(xp, received, blocks: int, islands: int, fmt: str, dtype):
    """An owner's chunk of `blocks` blocks: the mean of the islands' copies (received: theirs in island order,
    summed in that order so every layout gets the same bits), re-encoded per block in the same format."""
    size = chunk_bytes(blocks, fmt)
    total = _decode_blocks(xp, received[:size], blocks, fmt, dtype)
    for i in range(1, islands):
        total += _decode_blocks(xp, received[i * size:(i + 1) * size], blocks, fmt, dtype)
    codes, scale, _ = _encode_blocks(xp, total / np.dtype(dtype).type(islands), fmt)
    return xp.concatenate([codes, scale.view(np.uint8)])


def decode(xp, gathered, segments, islands: int, fmt: str, dtype):
    """The values of a whole payload (gathered: every chunk's in island order) for the segments, in dtype."""
    out, at = [], 0
    for a, b in chunks(blocks_of(segments), islands):
        size = chunk_bytes(b - a, fmt)
        out.append(_decode_blocks(xp, gathered[at:at + size], b - a, fmt, dtype))
        at += size
    x = xp.concatenate(out) if out else xp.zeros((0, BLOCK), dtype=dtype)
    return _unpadded(xp, x, segments, dtype)
