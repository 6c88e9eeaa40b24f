"""CuPy launcher of kernels/attention.cu: the fused causal attention of nn/flash.py on a GPU.

Tensors are (B, heads, T, hd) views in any strides whose last axis is contiguous (GPT's q, k, v straight
out of the fused qkv, Llama's v out of its projection, the outputs written straight into (B, T, H*hd)
arrays): each goes to the kernel as a pointer and three element strides. lse and D are contiguous
(B, H, T) arrays of the math type (float64 for float64, else float32).

Storage types: float32 ("f32"), float64 ("f64"), and bfloat16 held as uint16 bits ("bf16", float32 math;
`to_bf16` / `from_bf16` convert, rounding to nearest even as the kernel's stores do).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hpengine.device import kernels

HD_MAX = 128
# suffix -> (ROWS, TPR, KT), as instantiated by the ENTRIES lines of kernels/attention.cu
TILES = {"f32": (32, 4, 32), "bf16": (32, 4, 32), "f64": (16, 8, 16)}
_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.uint16): "bf16"}


class Launch(NamedTuple):
    entry: str
    grid: tuple
    block: tuple
    shared_mem: int


def suffix(dtype) -> str:
    try:
        return _SUFFIX[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"flash attention kernels take float32, float64 or bfloat16 bits (uint16), "
                         f"not {np.dtype(dtype)}") from None


def math_dtype(dtype):
    return np.dtype(np.float64) if suffix(dtype) == "f64" else np.dtype(np.float32)


def plan(op: str, dtype, B: int, H: int, KH: int, T: int, hd: int) -> Launch:
    """Grid, block and dynamic shared memory of op 'fwd', 'bwd_dq' or 'bwd_dkdv'."""
    if hd > HD_MAX or hd < 1:
        raise ValueError(f"flash attention kernels take head_dim <= {HD_MAX}, not {hd}")
    if H % KH:
        raise ValueError(f"{H} query heads do not split into groups of {KH} key/value heads")
    s = suffix(dtype)
    rows, tpr, kt = TILES[s]
    item = math_dtype(dtype).itemsize
    heads = KH if op == "bwd_dkdv" else H
    shared = 2 * kt * (hd + 1) * item if op == "bwd_dkdv" else 2 * kt * hd * item
    return Launch(f"flash_{op}_{s}", (math.ceil(T / rows), B * heads), (rows * tpr,), shared)


def _strided(xp, a, what):
    """(array, sb, sh, st) in elements; a copy when the last axis is not contiguous."""
    if a.ndim != 4:
        raise ValueError(f"flash attention: {what} must be (B, heads, T, hd), got shape {a.shape}")
    if a.shape[-1] > 1 and a.strides[-1] != a.itemsize or any(st % a.itemsize for st in a.strides):
        a = xp.ascontiguousarray(a)
    return (a,) + tuple(np.int64(st // a.itemsize) for st in a.strides[:3])


def _out(a, what):
    if a.ndim != 4 or (a.shape[-1] > 1 and a.strides[-1] != a.itemsize):
        raise ValueError(f"flash attention: output {what} must be a (B, heads, T, hd) view with a contiguous "
                         f"last axis, got shape {a.shape} strides {a.strides}")
    return (a,) + tuple(np.int64(st // a.itemsize) for st in a.strides[:3])


def _check(q, k, v):
    B, H, T, hd = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (T, hd) or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"flash attention: q {q.shape} {q.dtype}, k {k.shape} {k.dtype}, v {v.shape} {v.dtype} "
                         "do not fit (B, H, T, hd) and (B, K, T, hd) of one dtype")
    return B, H, k.shape[1], T, hd


def _launch(launch: Launch, args):
    kernels.function("attention", launch.entry)(launch.grid, launch.block, args, shared_mem=launch.shared_mem)


def forward(xp, q, k, v, o, scale: float):
    """o[...] = causal softmax(scale q k^T) v, grouped-query; returns lse (B, H, T)."""
    B, H, KH, T, hd = _check(q, k, v)
    at = math_dtype(q.dtype)
    lse = xp.empty((B, H, T), dtype=at)
    args = (*_strided(xp, q, "q"), *_strided(xp, k, "k"), *_strided(xp, v, "v"), *_out(o, "o"), lse,
            np.int32(H), np.int32(KH), np.int32(T), np.int32(hd), at.type(scale))
    _launch(plan("fwd", q.dtype, B, H, KH, T, hd), args)
    return lse


def backward(xp, q, k, v, o, do, lse, dq, dk, dv, scale: float):
    """Writes dq, dk, dv (views as forward's o) from forward's o and lse; dq first (it writes D)."""
    B, H, KH, T, hd = _check(q, k, v)
    at = math_dtype(q.dtype)
    if lse.shape != (B, H, T) or lse.dtype != at:
        raise ValueError(f"flash attention: lse must be ({B}, {H}, {T}) of {at}, got {lse.shape} {lse.dtype}")
    lse = xp.ascontiguousarray(lse)
    dd = xp.empty((B, H, T), dtype=at)
    qa, ka, va, da = (_strided(xp, a, w) for a, w in ((q, "q"), (k, "k"), (v, "v"), (do, "do")))
    tail = (np.int32(H), np.int32(KH), np.int32(T), np.int32(hd), at.type(scale))
    _launch(plan("bwd_dq", q.dtype, B, H, KH, T, hd),
            (*qa, *ka, *va, *_strided(xp, o, "o"), *da, lse, dd, *_out(dq, "dq"), *tail))
    _launch(plan("bwd_dkdv", q.dtype, B, H, KH, T, hd),
            (*qa, *ka, *va, *da, lse, dd, *_out(dk, "dk"), *_out(dv, "dv"), *tail))


# ---- bfloat16 bits -------------------------------------------------------------------------------------

def to_bf16(xp, a):
    """float32 values -> bfloat16 bits (uint16), rounding to nearest even; NaN -> 0x7fc0."""
    u = xp.ascontiguousarray(a, dtype=xp.float32).view(xp.uint32).astype(xp.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(xp.uint16)
    return xp.where((u & 0x7FFFFFFF) > 0x7F800000, xp.uint16(0x7FC0), r)


def from_bf16(xp, bits):
    """bfloat16 bits (uint16) -> float32 values (exact)."""
    return (xp.ascontiguousarray(bits).astype(xp.uint32) << 16).view(xp.float32)
