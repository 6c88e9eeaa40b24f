"""Activation caches and the parameters' compute copy in 2 bytes an element under bf16 amp
(strategy.amp.bf16_storage = "packed"): each float32 array a block keeps for its backward is stored as its
bfloat16 bits (uint16) once the forward has made it, and is float32 again for that block's backward only (one
block at a time); the compute copy is a uint16 flat buffer of bits, read through UnpackedParams.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpengine.device import kernels
from hpengine.device.backend import data_ptr
from hpengine.device.bf16_bits import from_bf16_bits, to_bf16_bits
from hpengine.layout.cache import map_cache

F32 = np.dtype(np.float32)


@dataclass(eq=False)
class Packed:
    """A float32 array kept as bfloat16 bits: `bits` (uint16, C order) of `shape`. Counted by
    layout/cache.cache_nbytes as an array of its own (nbytes, no base)."""
    bits: object
    shape: tuple
    base = None

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)


@dataclass(eq=False)
class PackedView:
    """A view into a Packed root: shape, strides and offset in elements. Its bytes are its root's (base)."""
    base: Packed
    shape: tuple
    strides: tuple
    offset: int
    nbytes = 0


# Packing goes by root array: views sharing storage (q, k and v of one qkv product, a linear's 2-D view of its
# input) pack that storage once and come back as views of one float32 array, so a cache takes exactly half
# its float32 bytes. NumPy and CuPy convert alike (device/bf16_bits.py): a packed run on NumPy equals the
# float32 emulation (device/precision.py) bit for bit, and the CPU tests stay the GPU path's oracle.
def _root(a):
    """The array a's storage belongs to (the end of its chain of bases that are arrays)."""
    while getattr(a.base, "dtype", None) is not None:
        a = a.base
    return a


def pack_cache(xp, cache, skip_roots: set):
    """The cache with its float32 arrays (not 0-d ones, not views of storage in skip_roots: parameters) as
    bfloat16 bits; other leaves are kept. The values must already be bfloat16 values for the packing to be
    exact (the engine stores nothing else under bf16 amp), or they are rounded to nearest even."""
    held: dict = {}         # storage id, or ("view", id) -> (what was packed, its Packed): alive until return

    def packed(key, src):
        if key not in held:
            held[key] = (src, Packed(to_bf16_bits(xp, src), tuple(src.shape)))
        return held[key][1]

    def one(a):
        if getattr(a, "dtype", None) != F32 or a.ndim == 0:
            return a
        root = _root(a)
        if id(root) in skip_roots:
            return a
        if a is root:
            return packed(id(root), root)
        off, rest = divmod(data_ptr(a) - data_ptr(root), 4)
        if (root.dtype != F32 or not root.flags.c_contiguous or rest
                or any(s < 0 or s % 4 for s in a.strides)):     # no element grid of its root to rebuild it on
            return packed(("view", id(a)), a)
        return PackedView(packed(id(root), root), tuple(a.shape), tuple(s // 4 for s in a.strides), off)

    return map_cache(cache, one)


def unpack_cache(xp, cache):
    """The cache with every Packed and PackedView as float32 again: each root converted once, its views rebuilt
    as views of that one array (writable: a backward may work in place on what it was handed)."""
    flats: dict = {}        # id(Packed) -> its float32 values, flat

    def flat(p: Packed):
        if id(p) not in flats:
            flats[id(p)] = (p, from_bf16_bits(xp, p.bits).reshape(-1))
        return flats[id(p)][1]

    def one(a):
        if isinstance(a, Packed):
            return flat(a).reshape(a.shape)
        if isinstance(a, PackedView):
            return xp.lib.stride_tricks.as_strided(flat(a.base)[a.offset:], a.shape, tuple(4 * s for s in a.strides))
        return a

    return map_cache(cache, one)



class UnpackedParams:
    """A block's parameters as its layers read them when the compute copy is bfloat16 bits: `[name]` is the
    float32 array of that tensor's values (from_bf16_bits, exact), converted on first access and kept for the
    life of this object, which the engine makes for one block's forward or backward: one block's float32
    weights at a time, as a gathered block under ZeRO-3. The GEMMs take the bits themselves (registered with
    num.hold_bits, num the run's nn/numerics.Numerics) for as long as this object lives. A tensor that only GEMMs read (gemm_weight(name):
    the linear layers' weights) is handed out as its bits (uint16), never converted. `together`: the block's
    other tensors (its norms' weights, biases, embeddings), converted all at once on the first access of any of
    them, in one launch (device/kernels.pack_bf16) for those that share one flat buffer."""

    def __init__(self, xp, buf, gemm_weight=None, together=(), num=None):
        self.xp, self.buf, self.values, self.num = xp, buf, {}, num
        self.gemm_weight = gemm_weight or (lambda name: False)
        self.together = together

    def __getitem__(self, name):
        if self.gemm_weight(name):
            return self.buf[name]
        if name not in self.values:
            self._convert([n for n in self.together if n in self.buf] if name in self.together else [name])
        return self.values[name]

    def _convert(self, names):
        bits = {n: self.buf[n] for n in names if n not in self.values}
        first = next(iter(bits.values()))
        root = _root(first)
        one = {n: b for n, b in bits.items() if _root(b) is root and b.flags.c_contiguous} \
            if root.ndim == 1 and root.flags.c_contiguous else {}
        if len(one) > 1:
            offsets = np.array([(data_ptr(b) - data_ptr(root)) // b.itemsize for b in one.values()], dtype=np.int64)
            sizes = np.array([b.size for b in one.values()], dtype=np.int64)
            flat = kernels.pack_bf16(self.xp.empty(int(sizes.sum()), dtype=np.float32), root, offsets, sizes)
            for (n, b), o, k in zip(one.items(), kernels.segment_starts(sizes), sizes):
                self._hold(n, flat[o:o + k].reshape(b.shape), b)
        for n, b in bits.items():
            if n not in self.values:
                self._hold(n, from_bf16_bits(self.xp, b), b)

    def _hold(self, name, values, bits):
        self.values[name] = values
        if self.num is not None:
            self.num.hold_bits(values, bits)   # the GEMMs read these bits, not the values converted back

    def __del__(self):
        if self.num is not None:
            for v in self.values.values():
                self.num.release_bits(v)

    def __contains__(self, name):
        return name in self.buf
