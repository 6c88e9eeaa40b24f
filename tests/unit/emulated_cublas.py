"""cuBLAS on the CuPy stand-in (emulated_cupy.py): gemmStridedBatchedEx and s/dgemmStridedBatched run from the raw
pointers they are handed, column-major, on the live device allocation each pointer falls in; an operand outside
every allocation, or reaching past one, fails.
"""
from __future__ import annotations

import ctypes
import types

import numpy as np
from emulated_arrays import _LIVE, LAUNCHES

from hpengine.device import bf16_bits

def _memory(ptr: int, itemsize: int, lo: int, hi: int, what: str) -> np.ndarray:
    """The elements [lo, hi) from ptr (element offsets) of the live device allocation ptr falls in, as one flat
    array of that allocation (offset 0 = ptr)."""
    for start, (end, ref) in list(_LIVE.items()):
        if ref() is not None and start <= ptr < end:
            assert (ptr - start) % itemsize == 0, f"{what}: pointer {ptr:#x} not aligned to {itemsize} bytes"
            assert start <= ptr + lo * itemsize and ptr + hi * itemsize <= end, \
                f"{what}: elements [{lo}, {hi}) from {ptr:#x} reach outside its allocation [{start:#x}, {end:#x})"
            count = (end - ptr) // itemsize
            ctype = {2: ctypes.c_uint16, 4: ctypes.c_float, 8: ctypes.c_double}[itemsize]
            return np.ctypeslib.as_array((ctype * count).from_address(ptr))
    raise AssertionError(f"{what}: pointer {ptr:#x} is in no device allocation")


def _operand(ptr, itemsize, rows, cols, ld, stride, batch, what):
    assert ld >= max(1, rows), f"{what}: ld {ld} < rows {rows}"
    hi = (rows - 1) + (cols - 1) * ld + (batch - 1) * stride + 1
    flat = _memory(ptr, itemsize, min(0, (batch - 1) * stride), hi, what)
    return np.lib.stride_tricks.as_strided(flat, (batch, rows, cols), (stride * itemsize, itemsize, ld * itemsize))


def _gemm(mod, name, transa, transb, m, n, k, alpha, beta, A, lda, sa, B, ldb, sb, C, ldc, sc, batch, isz, conv,
          c_bits=False):
    N = 0
    a = _operand(A, isz[0], *((m, k) if transa == N else (k, m)), lda, sa, batch, f"{name} A")
    b = _operand(B, isz[1], *((k, n) if transb == N else (n, k)), ldb, sb, batch, f"{name} B")
    c = _operand(C, isz[2], m, n, ldc, sc, batch, f"{name} C")
    a, b = conv(a), conv(b)
    a = a if transa == N else a.swapaxes(-1, -2)
    b = b if transb == N else b.swapaxes(-1, -2)
    prod = np.matmul(a, b)
    if c_bits:        # bfloat16 C: read as its values, alpha AB + beta C in float32, rounded once on the store
        acc = alpha * prod + (beta * conv(c) if beta != 0 else np.float32(0))
        c[...] = bf16_bits.bf16_bits_numpy(acc.astype(np.float32))
    else:
        c[...] = alpha * prod + (beta * c if beta != 0 else 0)
    mod.gemms.append((name, m, n, k, batch))
    LAUNCHES[f"cublas:{name}"] += 1


def make_cublas(mod) -> types.SimpleNamespace:
    f32, f64 = ctypes.c_float, ctypes.c_double

    def ex(handle, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc, batch, comp, algo):
        from hpengine.nn import bf16_gemm
        assert (at, bt, comp) == (bf16_gemm.CUDA_R_16BF, bf16_gemm.CUDA_R_16BF, bf16_gemm.CUBLAS_COMPUTE_32F) and \
            ct in (bf16_gemm.CUDA_R_32F, bf16_gemm.CUDA_R_16BF), (at, bt, ct, comp)
        c_bits = ct == bf16_gemm.CUDA_R_16BF
        _gemm(mod, "gemmStridedBatchedEx", ta, tb, m, n, k, f32.from_address(alpha).value,
              f32.from_address(beta).value, A, lda, sa, B, ldb, sb, C, ldc, sc, batch, (2, 2, 2 if c_bits else 4),
              lambda x: bf16_bits.from_bf16_bits(np, np.ascontiguousarray(x)), c_bits)

    def typed(name, ct, isz):
        def run(handle, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch):
            _gemm(mod, name, ta, tb, m, n, k, ct.from_address(alpha).value, ct.from_address(beta).value,
                  A, lda, sa, B, ldb, sb, C, ldc, sc, batch, (isz,) * 3, lambda x: x)
        return run

    modes = {}           # handle -> math mode (kept, not applied: the products stay float32)
    return types.SimpleNamespace(gemmStridedBatchedEx=ex, sgemmStridedBatched=typed("sgemmStridedBatched", f32, 4),
                                 dgemmStridedBatched=typed("dgemmStridedBatched", f64, 8),
                                 setMathMode=lambda handle, mode: modes.__setitem__(handle, mode),
                                 getMathMode=lambda handle: modes.get(handle, 0))


