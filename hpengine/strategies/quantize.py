"""The outer exchange's formats (DiLoCo's quantize): int8 or int4 per block of BLOCK values of each whole tensor
(params/blocks.py), one float32 scale each (max |x| / 127 or / 7 over the block wherever it is held: `maxed` takes the
island's MAX; round half to even; int4 two a byte as value + 8). A payload, per island chunk of whole global blocks:
each piece's codes padded to whole blocks, then a scale per run. Encoding, decoding, an owner's re-encoded mean.
"""
from __future__ import annotations

import numpy as np

from hpengine.params import blocks as blk

BLOCK = 256         # 4 bytes of scale per 256 values: 1.6 % on int8, 3.1 % on int4
LEVELS = {"int8": 127, "int4": 7}


def plan_of(segments) -> blk.Plan:
    """The Plan of whole tensors of these lengths, blocks from each one's start (islands of one rank)."""
    return blk.whole(segments, BLOCK)


class Wire:
    """Where a Plan's values sit in a payload cut into `islands` chunks: per chunk, its real values [v0, v1), its runs
    [r0, r1), its global blocks, and where its codes go among its padded pieces; per value, its run and place in it."""

    def __init__(self, plan: blk.Plan, islands: int, fmt: str):
        self.plan, self.fmt, self.M = plan, fmt, islands
        self.per = BLOCK if fmt == "int8" else BLOCK // 2
        lengths = plan.lengths
        self.run = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)          # each value's run
        self.pos = (np.arange(self.run.size) - np.repeat(plan.starts, lengths)).astype(np.int16)   # < BLOCK
        self.chunks = []
        for j, (r0, r1) in enumerate(plan.cuts(islands)):
            pieces = plan.pieces(r0, r1)
            padded = [-(-n // BLOCK) * BLOCK for _, n, _ in pieces]
            dest = np.concatenate([np.arange(n, dtype=np.int64) + off for (_, n, _), off in
                                   zip(pieces, np.cumsum([0] + padded[:-1]))]) if pieces else np.zeros(0, np.int64)
            v0 = pieces[0][0] if pieces else 0
            self.chunks.append({"v": (v0, v0 + dest.size), "runs": (r0, r1), "span": plan.block_span(j, islands),
                                "codes": sum(padded), "dest": dest,
                                "bytes": sum(padded) // BLOCK * self.per + 4 * (r1 - r0)})
        self.counts = [c["bytes"] for c in self.chunks]

    def scales(self, xp, x, v0: int, runs: tuple, span: tuple, levels: int, maxed):
        """The float32 scale of each of `runs` (r0, r1), whose values are x (from value v0): max |x| / levels of each
        whole block (maxed: the MAX of the island's ranks' scales over global blocks `span`; a rounded max / levels
        is monotone in the max, so the MAX of the scales is the scale of the MAX)."""
        r0, r1 = runs
        pad = xp.zeros((r1 - r0, BLOCK), dtype=x.dtype)
        if x.size:
            sl = slice(v0, v0 + x.size)
            pad[xp.asarray(self.run[sl] - r0), xp.asarray(self.pos[sl])] = xp.abs(x)
        scale = ((pad.max(axis=1) if r1 > r0 else pad[:, 0]) / levels).astype(np.float32)
        lo, hi = span
        if maxed is not None and hi > lo:
            ids = xp.asarray(self.plan.ids[r0:r1] - lo)
            whole = xp.zeros(hi - lo, dtype=np.float32)
            whole[ids] = scale
            maxed(whole)
            scale = whole[ids]
        return scale

    def encode(self, xp, x, c, scale):
        """(chunk c's payload bytes, the values they stand for) of its values x with its runs' scales."""
        levels = LEVELS[self.fmt]
        a, b = c["v"]
        s = scale[xp.asarray(self.run[a:b] - c["runs"][0])].astype(x.dtype)
        safe = xp.where(s > 0, s, x.dtype.type(1))
        q = xp.clip(xp.rint(x / safe), -levels, levels).astype(np.int8)
        seen = q.astype(x.dtype) * s
        full = xp.zeros(c["codes"], dtype=np.int8)
        full[xp.asarray(c["dest"])] = q
        if self.fmt == "int8":
            codes = full.view(np.uint8)
        else:
            u = (full + 8).astype(np.uint8)
            codes = u[0::2] | (u[1::2] << np.uint8(4))
        return xp.concatenate([codes, scale.view(np.uint8)]), seen

    def decode(self, xp, payload, c, dtype):
        """Chunk c's values from its payload bytes, in dtype."""
        r0, r1 = c["runs"]
        ncode = c["bytes"] - 4 * (r1 - r0)
        codes, scale = payload[:ncode], payload[ncode:c["bytes"]].view(np.float32)
        if self.fmt == "int8":
            q = codes.view(np.int8).astype(dtype)
        else:
            q = xp.empty(2 * codes.size, dtype=dtype)
            q[0::2] = (codes & np.uint8(15)).astype(dtype) - 8
            q[1::2] = (codes >> np.uint8(4)).astype(dtype) - 8
        a, b = c["v"]
        return q[xp.asarray(c["dest"])] * scale.astype(dtype)[xp.asarray(self.run[a:b] - r0)]


def _real(xp, plan, v):
    return v if plan.real is None else v[xp.asarray(plan.real)]


def _full(xp, plan, x, dtype):
    if plan.real is None:
        return x
    out = xp.zeros(plan.n, dtype=dtype)
    out[xp.asarray(plan.real)] = x
    return out


def encode(xp, v, wire: Wire, maxed=None):
    """(payload: uint8, every chunk's in island order; the dequantised values v as the others will read them;
    the chunks' byte counts) of v, the values the wire's Plan lays out."""
    x = _real(xp, wire.plan, v)
    runs = wire.plan.ids.size
    scale = wire.scales(xp, x, 0, (0, runs), (0, wire.plan.blocks), LEVELS[wire.fmt], maxed)    # one MAX for all
    parts, seen = [], []
    for c in wire.chunks:
        (a, b), (r0, r1) = c["v"], c["runs"]
        p, s = wire.encode(xp, x[a:b], c, scale[r0:r1])
        parts.append(p)
        seen.append(s)
    payload = xp.concatenate(parts) if parts else xp.zeros(0, dtype=np.uint8)
    out = xp.concatenate(seen) if seen else xp.zeros(0, dtype=v.dtype)
    return payload, _full(xp, wire.plan, out, v.dtype), list(wire.counts)


def mean_chunk(xp, received, wire: Wire, j: int, dtype, maxed=None):
    """Island j's chunk: the mean of the islands' copies (received: theirs in island order, summed in that order so
    every layout gets the same bits), re-encoded per whole block in the same format."""
    c, size = wire.chunks[j], wire.counts[j]
    total = wire.decode(xp, received[:size], c, dtype)
    for i in range(1, wire.M):
        total += wire.decode(xp, received[i * size:(i + 1) * size], c, dtype)
    mean = total / np.dtype(dtype).type(wire.M)
    scale = wire.scales(xp, mean, c["v"][0], c["runs"], c["span"], LEVELS[wire.fmt], maxed)
    return wire.encode(xp, mean, c, scale)[0]


def decode(xp, gathered, wire: Wire, dtype):
    """The values of a whole payload (gathered: every chunk's in island order), in dtype."""
    out, at = [], 0
    for c, size in zip(wire.chunks, wire.counts):
        out.append(wire.decode(xp, gathered[at:at + size], c, dtype))
        at += size
    x = xp.concatenate(out) if out else xp.zeros(0, dtype=dtype)
    return _full(xp, wire.plan, x, dtype)
