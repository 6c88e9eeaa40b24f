"""Batched matrix products on strided CuPy views, without copies: cuBLAS's strided-batched GEMM reads each
matrix through its leading dimension and a transpose flag, where cupy.matmul first copies every operand
that is not C-contiguous (attention's per-head q, k, v views of qkv, the transposed probabilities) and
writes a non-contiguous `out` through a temporary.
"""
from __future__ import annotations

import functools
import itertools
import math
import warnings
from typing import NamedTuple

import numpy as np

from hpengine.device import backend

N, T = 0, 1                       # cuBLAS operation codes (CUBLAS_OP_N, CUBLAS_OP_T)
MAX_LOOPED_CALLS = 4              # more calls than this only when copies are worth saving ...
COPY_WORTH_BYTES = 8 << 20        # ... i.e. cupy.matmul would copy at least this much


class Call(NamedTuple):
    """One cublas<t>gemmStridedBatched, column-major: C(m x n) = op(A) op(B) [+ C], offsets in elements."""
    transa: int
    transb: int
    m: int
    n: int
    k: int
    a_off: int
    lda: int
    stride_a: int
    b_off: int
    ldb: int
    stride_b: int
    c_off: int
    ldc: int
    stride_c: int
    batch: int


def _stored(rows: int, cols: int, sr: int, sc: int):
    """How cuBLAS, column-major, reads the logical (rows x cols) matrix with element strides (sr, sc), as
    (op, ld) with op(what it reads) = the matrix's transpose (what plan needs): N for a row-major matrix
    (read column-major it is the transpose), T for a column-major one; None when neither axis has unit
    stride or the leading dimension is too small."""
    if sc == 1 or cols == 1:                   # row-major: stored column-major it is the transpose
        ld = sr if rows > 1 else cols
        return (N, ld) if ld >= max(1, cols) else None
    if sr == 1 or rows == 1:                   # column-major: stored as is
        ld = sc if cols > 1 else rows
        return (T, ld) if ld >= max(1, rows) else None
    return None


def _merge(shape, strides_list):
    """Split the leading (batch) dims into looped dims and one merged batch dim with a uniform stride per
    operand: (looped dims, batch size, batch strides)."""
    dims = [i for i, s in enumerate(shape) if s != 1]
    split = len(dims)
    while split > 0:
        i = dims[split - 1]
        if split < len(dims):
            j = dims[split]
            if not all(st[i] == st[j] * shape[j] for st in strides_list):
                break
        split -= 1
    merged = dims[split:]
    batch = math.prod(shape[i] for i in merged)
    strides = [st[merged[-1]] if merged else 0 for st in strides_list]
    return dims[:split], batch, strides


# `plan` turns shapes and strides (in elements) into cuBLAS calls and is pure, so the CPU tests check it
# against NumPy by emulating the calls (tests/unit/test_gemm_plan.py); `matmul` launches them on CuPy.
@functools.lru_cache(maxsize=1024)      # a step repeats the same few shapes: plan each once
def plan(a_shape, a_strides, b_shape, b_strides, c_shape, c_strides) -> tuple[Call, ...] | None:
    """cuBLAS calls computing c = a @ b for views given by shapes and element strides (equal leading
    dims, no broadcasting; tuples); None when an operand has no unit stride in its last two dims or c is
    not row-major."""
    *lead, M, K = a_shape
    *lead_b, K2, Nn = b_shape
    if list(lead) != list(lead_b) or list(c_shape) != list(lead) + [M, Nn] or K != K2:
        return None
    sa, sb, sc = _stored(M, K, *a_strides[-2:]), _stored(K, Nn, *b_strides[-2:]), _stored(M, Nn, *c_strides[-2:])
    if sa is None or sb is None or sc is None or sc[0] != N:
        return None
    looped, batch, (bsa, bsb, bsc) = _merge(lead, [a_strides[:-2], b_strides[:-2], c_strides[:-2]])
    calls = []
    for idx in itertools.product(*(range(lead[i]) for i in looped)):
        oa = sum(a_strides[i] * x for i, x in zip(looped, idx))
        ob = sum(b_strides[i] * x for i, x in zip(looped, idx))
        oc = sum(c_strides[i] * x for i, x in zip(looped, idx))
        # row-major C = A B  <=>  column-major C^T = B^T A^T: cuBLAS's A is b, its B is a
        calls.append(Call(sb[0], sa[0], Nn, M, K, ob, sb[1], bsb, oa, sa[1], bsa, oc, sc[1], bsc, batch))
    return tuple(calls)


def elements(x) -> tuple:
    """Array x's strides in elements (what plan takes)."""
    return tuple(s // x.itemsize for s in x.strides)


def span(x) -> tuple:
    """[first byte, last byte + 1) that view x touches."""
    p = backend.data_ptr(x)
    lo = p + sum(min(0, s * (n - 1)) for s, n in zip(x.strides, x.shape))
    hi = p + sum(max(0, s * (n - 1)) for s, n in zip(x.strides, x.shape)) + x.itemsize
    return lo, hi


def _overlaps(x, y) -> bool:
    (a, b), (c, d) = span(x), span(y)
    return a < d and c < b


def _copied_bytes(a, b, out) -> int:
    """What cupy.matmul would copy: each operand that is not C-contiguous, and a non-contiguous out twice."""
    return sum(x.nbytes for x in (a, b) if not x.flags.c_contiguous) + \
        (2 * out.nbytes if out is not None and not out.flags.c_contiguous else 0)


def matmul(xp, a, b, out=None, accumulate=False):
    """out = a @ b (or out += a @ b) on CuPy arrays of float32/float64, through strided-batched cuBLAS
    when that saves copies; cupy.matmul otherwise. Returns out."""
    if out is None:
        out = xp.empty(a.shape[:-1] + b.shape[-1:], dtype=a.dtype)
        accumulate = False
    calls = None
    if a.ndim >= 2 and a.dtype == b.dtype == out.dtype and a.dtype in (np.float32, np.float64) and \
            all(s % a.itemsize == 0 for x in (a, b, out) for s in x.strides) and \
            not _overlaps(out, a) and not _overlaps(out, b):
        calls = plan(a.shape, elements(a), b.shape, elements(b), out.shape, elements(out))
    if calls is None or (len(calls) > MAX_LOOPED_CALLS and _copied_bytes(a, b, out) < COPY_WORTH_BYTES) or \
            not _works(xp, a.dtype):
        if accumulate:
            out += xp.matmul(a, b)
        else:
            xp.matmul(a, b, out=out)
        return out
    _launch(xp, calls, a, b, out, accumulate)
    return out


def _works(xp, dtype) -> bool:
    """Once per dtype: a small strided product against cupy.matmul, so a CuPy whose cuBLAS binding differs
    (say, scalars by value rather than by pointer) falls back to cupy.matmul with a warning."""
    return _probe(xp, np.dtype(dtype))


@functools.lru_cache(maxsize=None)
def _probe(xp, key) -> bool:
    # memo of the probe's answer for (array module, dtype): the binding does not change within a process
    try:
        a = (xp.arange(2 * 3 * 4, dtype=key).reshape(2, 4, 3) / 7).swapaxes(-1, -2)   # transposed
        b = xp.arange(2 * 4 * 5, dtype=key).reshape(2, 4, 5) / 5
        out = xp.zeros((2, 3, 5), dtype=key)
        _launch(xp, plan(a.shape, elements(a), b.shape, elements(b), out.shape, elements(out)), a, b, out, False)
        ok = bool(xp.allclose(out, xp.matmul(a, b)))
    except Exception as e:  # noqa: BLE001 - any failure means: use cupy.matmul
        ok, why = False, f"{type(e).__name__}: {e}"
    else:
        why = "results differ from cupy.matmul"
    if not ok:
        warnings.warn(f"strided cuBLAS GEMM disabled for {key} ({why}); using cupy.matmul", stacklevel=2)
    return ok


def _launch(xp, calls, a, b, out, accumulate):
    cublas = backend.cublas_module()
    handle = xp.cuda.device.get_cublas_handle()
    gemm = cublas.sgemmStridedBatched if a.dtype == np.float32 else cublas.dgemmStridedBatched
    one, beta = np.ones(1, a.dtype), np.full(1, 1.0 if accumulate else 0.0, a.dtype)
    isz = a.itemsize
    for c in calls:
        gemm(handle, c.transa, c.transb, c.m, c.n, c.k, one.ctypes.data,
             b.data.ptr + c.a_off * isz, c.lda, c.stride_a, a.data.ptr + c.b_off * isz, c.ldb, c.stride_b,
             beta.ctypes.data, out.data.ptr + c.c_off * isz, c.ldc, c.stride_c, c.batch)
