"""bfloat16 as a storage format, emulated on float32 arrays: the values are rounded to the nearest
bfloat16 (ties to even, as ml_dtypes and CUDA's __float2bfloat16_rn do) and kept in float32, so NumPy's
float32 BLAS and every float32 kernel compute on them unchanged.
"""
from __future__ import annotations

import numpy as np

from hpengine.device.backend import on_host
from hpengine.device.bf16_bits import round_bf16_cupy_, to_bf16_bits

# Under strategy.amp with dtype = "bfloat16" the engine rounds at the points where a bf16 implementation
# stores a tensor: the compute copy of the parameters (written from the float32 masters by the AdamW pass
# itself, kernels.adamw_numpy and the adamw_f32_bf16 kernel, after initialisation and after a load), every block's output activation and its saved activations
# (caches), every block's input gradient in backward and, with amp.grad_dtype = "bfloat16", the gradients
# after each block's backward and after each sum (strategies/amp.Precision lists them). With
# amp.bf16_storage = "packed" the caches, and bfloat16 gradients, are then held as bfloat16 bits instead
# (strategies/bf16_storage.py, strategies/base.py), the same values in 2 bytes. Every GEMM takes bfloat16
# operands and sums in float32 (nn/bf16_gemm.py, under the policy the layers are handed: nn/numerics.py); inside
# a block, what only GEMMs or bfloat16-reading kernels take is stored by its producer as bfloat16 (store_for_gemm,
# product_stored: rounded here, bits when packed); the rest of a block's arithmetic is float32, as inside a fused kernel that
# reads bf16 and computes in fp32.
EXP = 0x7F800000


def round_bf16_(xp, a):
    """Round float32 array a in place to bfloat16 values (nearest, ties to even); inf stays inf, NaN NaN.
    Returns a."""
    if a.dtype != np.float32:
        raise TypeError(f"bf16 rounding needs float32 storage, got {a.dtype}")
    if a.size == 0:
        return a
    if not on_host(a):     # CuPy: one kernel (the steps below sync the host twice)
        return round_bf16_cupy_(xp, a)
    u = a.view(xp.uint32)
    special = (u & EXP) == EXP                   # inf or NaN: never carried into the exponent
    bias = (u >> 16) & 1
    bias += 0x7FFF
    bias[special] = 0
    nan = xp.isnan(a) if bool(special.any()) else None
    u += bias
    u &= xp.uint32(0xFFFF0000)
    if nan is not None:
        a[nan] = np.nan                          # a payload only in the low bits would truncate to inf
    return a


def write_copy(xp, copy, p) -> None:
    """amp's compute copy of the float32 values p as the optimizers write it: float16, float32 holding the
    nearest bfloat16 values, or uint16 holding their bits."""
    if copy.dtype == np.uint16:
        copy[...] = to_bf16_bits(xp, p)
    else:
        copy[...] = p
        if copy.dtype == np.float32:
            round_bf16_(xp, copy)
