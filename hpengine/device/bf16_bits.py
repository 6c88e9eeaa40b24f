"""bfloat16 bits: float32 arrays to the uint16 bit patterns of their nearest bfloat16 (ties to even) and back,
one pass each way on CuPy (ElementwiseKernels) and the same integer arithmetic on NumPy. The bf16 GEMMs take
these bits as operands (nn/bf16_gemm.py) and packed activation caches keep them (strategies/bf16_storage.py).
"""
from __future__ import annotations

import numpy as np

# Bits rather than an array dtype: NumPy has no bfloat16, and CuPy's support for ml_dtypes.bfloat16 arrays is
# recent and partial (docs/gpu.md); uint16 bits work on every CuPy and are what cuBLAS and our kernels read.
#
# float32 x -> uint16 y, the bfloat16 nearest x (ties to even); inf stays inf, a NaN stays a NaN (a payload
# only in the low half would otherwise truncate to inf). The body of cupy.ElementwiseKernel; the CPU tests
# compile it inside a __global__ function with nvcc.
TO_BF16_BODY = """
unsigned int u = __float_as_uint(x);
if ((u & 0x7F800000u) == 0x7F800000u) {
    y = (unsigned short)((u >> 16) | ((u & 0x007FFFFFu) ? 0x0040u : 0u));
} else {
    u += 0x7FFFu + ((u >> 16) & 1u);
    y = (unsigned short)(u >> 16);
}
"""
# uint16 b -> float32 y: the bfloat16 value those bits hold, exactly (the high half of a float32)
FROM_BF16_BODY = """
y = __uint_as_float(((unsigned int)b) << 16);
"""
# float32 x -> float32 y, x rounded to its nearest bfloat16 (ties to even) in float32 storage: precision.round_bf16_
# in one pass with no host sync (inf stays inf, a NaN becomes the canonical quiet NaN round_bf16_ writes)
ROUND_BF16_BODY = """
unsigned int u = __float_as_uint(x);
if ((u & 0x7F800000u) == 0x7F800000u) {
    y = (u & 0x007FFFFFu) ? __uint_as_float(0x7FC00000u) : x;
} else {
    u += 0x7FFFu + ((u >> 16) & 1u);
    y = __uint_as_float(u & 0xFFFF0000u);
}
"""
_KERNELS: dict = {}
_BODIES = {"to": ("float32 x", "uint16 y", TO_BF16_BODY), "from": ("uint16 b", "float32 y", FROM_BF16_BODY),
           "round": ("float32 x", "float32 y", ROUND_BF16_BODY)}


def _kernel(xp, name: str):
    if name not in _KERNELS:
        ins, outs, body = _BODIES[name]
        _KERNELS[name] = xp.ElementwiseKernel(ins, outs, body, f"hpengine_{name}_bf16")
    return _KERNELS[name]


def to_bf16_bits(xp, a, out=None):
    """The bfloat16 bits (uint16, C-contiguous, a's shape) of float32 array a, in one pass over any strides;
    written into `out` (uint16, a's shape) when given, and returned."""
    if xp.__name__ != "cupy":
        if out is None:
            return bf16_bits_numpy(a)
        out[...] = bf16_bits_numpy(a)
        return out
    return _kernel(xp, "to")(a, xp.empty(a.shape, dtype=np.uint16) if out is None else out)


def from_bf16_bits(xp, bits):
    """The float32 values (C-contiguous, bits' shape) that bfloat16 bits (uint16) hold."""
    if xp.__name__ != "cupy":
        u = np.asarray(bits, dtype=np.uint16).astype(np.uint32)
        u <<= 16
        return u.view(np.float32)
    return _kernel(xp, "from")(bits, xp.empty(bits.shape, dtype=np.float32))


def round_bf16_cupy_(xp, a):
    """a (float32 CuPy array, any strides) rounded in place to bfloat16 values by ROUND_BF16_BODY; returns a."""
    return _kernel(xp, "round")(a, a)


def bf16_bits_numpy(a: np.ndarray) -> np.ndarray:
    """TO_BF16_BODY in NumPy: for every value but a NaN these are the bits precision.round_bf16_ rounds to
    (a NaN keeps its sign and high payload, quiet bit set; round_bf16_ writes the canonical NaN)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    special = (u & 0x7F800000) == 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    kept = ((u >> 16) | np.where((u & 0x007FFFFF) != 0, 0x0040, 0)).astype(np.uint16)
    return np.where(special, kept, rounded).astype(np.uint16)


def store_values_(xp, dst, vals) -> None:
    """Write float values into dst: as their bfloat16 bits (nearest, ties to even) when dst is a uint16 buffer
    of bits (packed parameters), else cast to dst's dtype."""
    if dst.dtype == np.uint16:
        dst[...] = to_bf16_bits(xp, xp.asarray(vals, dtype=np.float32))
    else:
        dst[...] = xp.asarray(vals, dtype=dst.dtype)


def as_float32(xp, a):
    """a's values as float32 when a holds bfloat16 bits (uint16), else a itself."""
    return from_bf16_bits(xp, a) if a.dtype == np.uint16 else a
