"""CuPy launcher of kernels/attention.cu and kernels/attention_mma.cu: the fused causal attention of nn/flash.py
on a GPU, over strided (B, heads, T, hd) views, in float32, float64 or bfloat16 bits, on the tensor-core
entries under bf16 amp; packed documents as the kernels' segment ids.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hpengine.device import kernels

HD_MAX = 128
# suffix -> (ROWS, TPR, KT), as instantiated by the ENTRIES lines of kernels/attention.cu
TILES = {"f32": (32, 4, 32), "bf16": (32, 4, 32), "f64": (16, 8, 16)}
# Storage types: float32 ("f32"), float64 ("f64"), and bfloat16 held as uint16 bits ("bf16", float32 math;
# `to_bf16` / `from_bf16` convert, rounding to nearest even as the kernel's stores do).
_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.uint16): "bf16"}
# attention_mma.cu: head dim bound HD -> (BN, BNQ, QT), as instantiated by its MMA_ENTRIES lines; each warp
# owns 16 rows, a block MMA_WARPS warps; shared tiles are bfloat16 rows of HD + MMA_PAD
MMA_TILES = {64: (64, 64, 64), 128: (64, 32, 16)}
MMA_WARPS = 4
MMA_PAD = 8


# The kernels' last argument, seg: (B, T) int32 document ids (nondecreasing along a row, as data/documents.py
# makes them), or a null pointer (8 zero bytes, what a pointer argument of value 0 is) for one document a row.
NULL = np.uint64(0)


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


def _dims(H: int, KH: int, hd: int) -> None:
    if hd > HD_MAX or hd < 1:
        raise ValueError(f"flash attention kernels take head_dim <= {HD_MAX}, not {hd}")
    if H % KH:
        raise ValueError(f"{H} query heads do not split into groups of {KH} key/value heads")


def launch_plan(op: str, dtype, B: int, H: int, KH: int, T: int, hd: int) -> Launch:
    """Grid, block and dynamic shared memory of op 'fwd', 'bwd_dq' or 'bwd_dkdv'."""
    _dims(H, KH, hd)
    s = suffix(dtype)
    rows, tpr, kt = TILES[s]
    item = math_dtype(dtype).itemsize
    heads = KH if op == "bwd_dkdv" else H
    shared = 2 * kt * (hd + 1) * item if op == "bwd_dkdv" else 2 * kt * hd * item
    return Launch(f"flash_{op}_{s}", (math.ceil(T / rows), B * heads), (rows * tpr,), shared)


def plan_mma(op: str, dtype, B: int, H: int, KH: int, T: int, hd: int) -> Launch:
    """launch_plan for the tensor-core entries of attention_mma.cu (float32 or bfloat16-bits storage)."""
    _dims(H, KH, hd)
    s = suffix(dtype)
    if s == "f64":
        raise ValueError("flash attention: the tensor-core kernels take float32 or bfloat16 bits (uint16), "
                         "not float64")
    bound = 64 if hd <= 64 else 128
    bn, bnq, qt = MMA_TILES[bound]
    row = 2 * (bound + MMA_PAD)                       # bytes of one shared bfloat16 row
    rows = 16 * MMA_WARPS
    shared = {"fwd": 2 * bn * row, "bwd_dq": 2 * bnq * row, "bwd_dkdv": 2 * (rows + qt) * row + 8 * qt}[op]
    heads = KH if op == "bwd_dkdv" else H
    return Launch(f"flash_mma_{op}_{s}_hd{bound}", (math.ceil(T / rows), B * heads), (32 * MMA_WARPS,), shared)


# Under bf16 amp (nn/flash.py passes use_mma(dtype, num.bf16) as `mma=`) float32 and bfloat16-bits inputs go
# to the tensor-core entries of attention_mma.cu instead: every product with bfloat16 operands and float32
# sums, as the twin's GEMMs are then. An explicit mma=True on float64 is refused (plan_mma).
def use_mma(dtype, mma: bool = False) -> bool:
    """Whether the tensor-core entries run for mma asked (bf16 amp): never for float64."""
    return bool(mma) and suffix(dtype) != "f64"


# Tensors are (B, heads, T, hd) views in any strides whose last axis is contiguous (GPT's q, k, v straight
# out of the fused qkv, Llama's v out of its projection, the outputs written straight into (B, T, H*hd)
# arrays): each goes to the kernel as a pointer and three element strides. lse and D are contiguous
# (B, H, T) arrays of the math type (float64 for float64, else float32).
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
    if (k.shape[:3] != v.shape[:3] or not 1 <= v.shape[-1] <= hd or k.shape[0] != B or k.shape[2:] != (T, hd)
            or q.dtype != k.dtype or q.dtype != v.dtype):
        raise ValueError(f"flash attention: q {q.shape} {q.dtype}, k {k.shape} {k.dtype}, v {v.shape} {v.dtype} "
                         "do not fit (B, H, T, hd), (B, K, T, hd) and (B, K, T, dv <= hd) of one dtype")
    return B, H, k.shape[1], T, hd


# Values narrower than the queries and keys (multi-head latent attention: dv < hd) reach the kernels, which take
# one head width, zero-padded to hd, as the context-parallel drivers pad them: the padded columns of the output
# are exact zeros (sums of p * 0) and are cut off, and their output gradient is zero, so D = rowsum(dO * O), the
# scores' gradient and dq, dk are those of the narrow values; dv's padded columns (sums of p * 0) are cut off.
def _padded(xp, a, hd: int):
    """a (..., dv) as a new contiguous (..., hd) array with zero columns past dv; a itself when dv == hd."""
    if a.shape[-1] == hd:
        return a
    out = xp.zeros(a.shape[:-1] + (hd,), dtype=a.dtype)
    out[..., :a.shape[-1]] = a
    return out


def _wide_out(xp, a, hd: int):
    """Where a kernel writes an output that is a (..., dv) view: a itself, or a new (..., hd) array to cut."""
    return a if a.shape[-1] == hd else xp.empty(a.shape[:-1] + (hd,), dtype=a.dtype)


def _launch(launch: Launch, args):
    name = "attention_mma" if launch.entry.startswith("flash_mma_") else "attention"
    kernels.function(name, launch.entry)(launch.grid, launch.block, args, shared_mem=launch.shared_mem)


def _docs(xp, segments, B: int, T: int):
    """The seg argument: NULL, or the document ids as a contiguous int32 (B, T) device array."""
    if segments is None:
        return NULL
    if tuple(segments.shape) != (B, T):
        raise ValueError(f"flash attention: segments must be (B, T) = ({B}, {T}), got shape {tuple(segments.shape)}")
    return xp.ascontiguousarray(xp.asarray(segments).astype(np.int32, copy=False))


def _planner(dtype, mma):
    # an explicit mma=True on float64 reaches plan_mma, which refuses it
    return plan_mma if mma or use_mma(dtype, mma) else launch_plan


def forward(xp, q, k, v, o, scale: float, mma: bool = False, segments=None):
    """o[...] = causal softmax(scale q k^T) v, grouped-query; returns lse (B, H, T). v and o may be narrower
    than q and k (dv < hd: zero-padded for the kernels). mma: tensor-core kernels (bf16 amp). segments: (B, T)
    document ids (None: one document a row)."""
    B, H, KH, T, hd = _check(q, k, v)
    seg = _docs(xp, segments, B, T)
    plan_of = _planner(q.dtype, mma)
    at = math_dtype(q.dtype)
    lse = xp.empty((B, H, T), dtype=at)
    ow = _wide_out(xp, o, hd)
    args = (*_strided(xp, q, "q"), *_strided(xp, k, "k"), *_strided(xp, _padded(xp, v, hd), "v"), *_out(ow, "o"),
            lse, np.int32(H), np.int32(KH), np.int32(T), np.int32(hd), at.type(scale), seg)
    _launch(plan_of("fwd", q.dtype, B, H, KH, T, hd), args)
    if ow is not o:
        o[...] = ow[..., :o.shape[-1]]
    return lse


def backward(xp, q, k, v, o, do, lse, dq, dk, dv, scale: float, mma: bool = False, segments=None):
    """Writes dq, dk, dv (views as forward's o) from forward's o and lse; dq first (it writes D). v, o, do and dv
    may be narrower than q and k, as in forward. mma and segments as in forward (the lse of either kernel family
    serves both)."""
    B, H, KH, T, hd = _check(q, k, v)
    seg = _docs(xp, segments, B, T)
    plan_of = _planner(q.dtype, mma)
    at = math_dtype(q.dtype)
    if lse.shape != (B, H, T) or lse.dtype != at:
        raise ValueError(f"flash attention: lse must be ({B}, {H}, {T}) of {at}, got {lse.shape} {lse.dtype}")
    lse = xp.ascontiguousarray(lse)
    dd = xp.empty((B, H, T), dtype=at)
    v, o, do = (_padded(xp, a, hd) for a in (v, o, do))
    qa, ka, va, da = (_strided(xp, a, w) for a, w in ((q, "q"), (k, "k"), (v, "v"), (do, "do")))
    tail = (np.int32(H), np.int32(KH), np.int32(T), np.int32(hd), at.type(scale), seg)
    _launch(plan_of("bwd_dq", q.dtype, B, H, KH, T, hd),
            (*qa, *ka, *va, *_strided(xp, o, "o"), *da, lse, dd, *_out(dq, "dq"), *tail))
    dvw = _wide_out(xp, dv, hd)
    _launch(plan_of("bwd_dkdv", q.dtype, B, H, KH, T, hd),
            (*qa, *ka, *va, *da, lse, dd, *_out(dk, "dk"), *_out(dvw, "dv"), *tail))
    if dvw is not dv:
        dv[...] = dvw[..., :dv.shape[-1]]


# ---- bfloat16 bits -------------------------------------------------------------------------------------

def to_bf16(xp, a):
    """float32 values -> bfloat16 bits (uint16), rounding to nearest even; NaN -> 0x7fc0."""
    u = xp.ascontiguousarray(a, dtype=xp.float32).view(xp.uint32).astype(xp.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(xp.uint16)
    return xp.where((u & 0x7FFFFFFF) > 0x7F800000, xp.uint16(0x7FC0), r)


def from_bf16(xp, bits):
    """bfloat16 bits (uint16) -> float32 values (exact)."""
    return (xp.ascontiguousarray(bits).astype(xp.uint32) << 16).view(xp.float32)
