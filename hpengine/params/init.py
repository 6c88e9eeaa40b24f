"""Layout-invariant initialisation: a tensor's values depend only on (seed, global name, element index).

Each element's value comes from a counter-based hash of its global flat index, so a rank holding any
slice (tensor-parallel, sharded) computes exactly that slice without materialising the rest.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
CHUNK = 1 << 14          # elements hashed at a time (normal_slice): its temporaries stay in L2


def _key(seed: int, name: str) -> np.uint64:
    h = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(h, "little"))


def _mix(z: np.ndarray) -> np.ndarray:
    # splitmix64 finaliser; uint64 arithmetic wraps, which is what we want
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _flat_indices(global_shape, slices) -> np.ndarray:
    """Global C-order flat indices of the elements in `slices`, built from per-dim aranges."""
    idx = np.zeros((1,) * len(global_shape), dtype=np.uint64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        s = slices[d]
        shape = [1] * len(global_shape)
        shape[d] = s.stop - s.start
        idx = idx + (np.arange(s.start, s.stop, dtype=np.uint64) * np.uint64(stride)).reshape(shape)
        stride *= global_shape[d]
    return idx


def _normal(key: np.uint64, idx: np.ndarray, std: float) -> np.ndarray:
    """Box-Muller standard normals * std of the hashed indices idx (float64)."""
    base = key + (idx * np.uint64(2) + np.uint64(1)) * _GOLDEN
    u1 = ((_mix(base) >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53   # (0, 1]
    u2 = (_mix(base + _GOLDEN) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53  # [0, 1)
    return std * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def normal_slice(seed: int, name: str, global_shape, slices, std: float) -> np.ndarray:
    """Standard-normal * std values (float64, host) of the given slice of a tensor.

    Made CHUNK elements (whole rows of the first dim) at a time: the hash's dozen uint64 temporaries then stay
    in cache instead of each being as large as the tensor (a 32,000 x 2,048 embedding: 0.5 GB apiece), several
    times faster and with a small peak. Each value depends on its index alone, so the chunks change nothing."""
    shape = tuple(s.stop - s.start for s in slices)
    key = _key(seed, name)
    if not shape:
        return _normal(key, _flat_indices(global_shape, slices), std)
    out = np.empty(shape)
    per_row = math.prod(shape[1:])
    rows = max(1, CHUNK // max(per_row, 1))
    first = slices[0]
    for r in range(0, shape[0], rows):
        part = (slice(first.start + r, min(first.stop, first.start + r + rows)),) + tuple(slices[1:])
        out[r:r + rows] = _normal(key, _flat_indices(global_shape, part), std)
    return out


def init_tensor(spec, seed: int, slices=None) -> np.ndarray:
    """Host float64 values of `slices` (default: whole tensor) of the tensor described by spec."""
    slices = slices or tuple(slice(0, n) for n in spec.global_shape)
    shape = tuple(s.stop - s.start for s in slices)
    if spec.init == "zeros":
        return np.zeros(shape)
    if spec.init == "ones":
        return np.ones(shape)
    if spec.init == "normal":
        seed = seed if spec.seed is None else spec.seed
        if spec.true_shape is None:
            return normal_slice(seed, spec.init_key or spec.name, spec.global_shape, slices, spec.std)
        # padded tensor: values keyed on the unpadded shape (so they equal the unpadded run's), pads 0
        out = np.zeros(shape)
        inner = tuple(slice(s.start, min(s.stop, n)) for s, n in zip(slices, spec.true_shape))
        if all(s.stop > s.start for s in inner):
            dst = tuple(slice(0, s.stop - s.start) for s in inner)
            out[dst] = normal_slice(seed, spec.init_key or spec.name, spec.true_shape, inner, spec.std)
        return out
    raise ValueError(f"tensor {spec.name}: unknown init {spec.init!r}")


def init_flat(buf, seed: int, r=None) -> None:
    """Fill a FlatBuffer (or only the part of it inside Range r) with layout-invariant values."""
    lay = buf.layout
    names = [(n, lay.ranges[n], 0) for n in lay.names] if r is None else list(lay.tensors_in(r))
    for name, part, off in names:
        spec = lay.by_name[name]
        vals = init_tensor(spec, seed, lay.box(name)).reshape(-1)
        chunk = vals[off:off + part.size]
        buf.data[part.slice] = buf.xp.asarray(chunk, dtype=buf.data.dtype)


def init_range(layout, seed: int, r, xp, dtype):
    """Layout-invariant values of flat Range r only (what a stage-3 owner stores)."""
    out = np.zeros(r.size)
    for name, part, off in layout.tensors_in(r):
        spec = layout.by_name[name]
        vals = init_tensor(spec, seed, layout.box(spec.name)).reshape(-1)
        out[part.start - r.start:part.stop - r.start] = vals[off:off + part.size]
    return xp.asarray(out, dtype=dtype)


def init_parts(layout, seed: int, parts, xp, dtype):
    """Layout-invariant values of a rank's owned parts (params.buffers.packed), one after another."""
    if len(parts) == 1:
        return init_range(layout, seed, parts[0][0], xp, dtype)
    return xp.concatenate([init_range(layout, seed, r, xp, dtype) for r, _ in parts]) if parts else \
        xp.zeros(0, dtype=dtype)
