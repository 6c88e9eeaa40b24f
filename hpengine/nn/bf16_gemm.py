"""Matrix products with bfloat16 operands and float32 accumulation, as a bf16 implementation runs every
GEMM on tensor cores (cuBLAS with CUDA_R_16BF inputs and CUBLAS_COMPUTE_32F; Megatron's bf16 training).
Stateless: the products (`matmul`, `product_bits`), operands read through a held registry the caller owns
(nn/numerics.py) and the cuBLAS launch (`launch_args`); NumPy emulates each path."""
from __future__ import annotations

import numpy as np

from hpengine.device import backend
from hpengine.device.bf16_bits import from_bf16_bits, to_bf16_bits
from hpengine.device.precision import round_bf16_
from hpengine.nn import gemm

# Under strategy.amp with dtype = "bfloat16" the layers are handed a bf16 policy (nn/numerics.Numerics); their
# GEMMs (linear forward and both backward products, every attention product) then come here. Arrays stay
# float32 (precision.py's emulated storage) and the operands are rounded to the nearest bfloat16 on the way
# in:
# - NumPy: rounded float32 copies multiplied by float32 BLAS. A product of two bf16 values is exact in
#   float32 (8 + 8 significant bits), so this is the tensor-core GEMM up to the order of the float32 sums.
# - CuPy: each operand converted once to bf16 bits (uint16, contiguous; one pass that reads the strided
#   view: device/bf16_bits.py), then cublasGemmStridedBatchedEx over the calls gemm.plan makes for those
#   contiguous copies and the (possibly strided) float32 output, which it writes or accumulates into.
CUDA_R_32F, CUDA_R_16BF = 0, 14            # cudaDataType_t
CUBLAS_COMPUTE_32F = 68                    # cublasComputeType_t
CUBLAS_GEMM_DEFAULT = -1                   # cublasGemmAlgo_t: cuBLAS picks (tensor cores for bf16)


def matmul(xp, a, b, out=None, accumulate=False, held=None):
    """out = a @ b (or out += a @ b) with a and b rounded to bfloat16 (or given as their bits, uint16), float32
    products and sums; float32 out (equal leading dims, as gemm.plan takes them). Returns out. held: the
    registry of arrays whose bfloat16 operands are at hand (nn/numerics.Numerics.held), or None."""
    if any(x.dtype not in (np.float32, np.uint16) for x in (a, b)):
        raise TypeError(f"bf16 operands are float32 values or uint16 bits, got {a.dtype} @ {b.dtype}")
    if xp.__name__ != "cupy":
        r = _values(xp, a, held) @ _values(xp, b, held)
        if out is None:
            return r
        if accumulate:
            out += r
        else:
            out[...] = r
        return out
    if out is None:
        out = xp.empty(a.shape[:-1] + b.shape[-1:], dtype=np.float32)
        accumulate = False
    a16, b16 = (_bits(xp, x, held) for x in (a, b))
    target = out
    if _plan(a16, b16, out) is None:     # an output cuBLAS cannot write in place: a contiguous one first
        target = xp.empty(out.shape, dtype=np.float32)
    calls, a16, b16 = _planned(xp, a16, b16, target)
    _launch(xp, calls, a16, b16, target, accumulate and target is out)
    if target is not out:
        if accumulate:
            out += target
        else:
            out[...] = target
    return out


# The held registry (nn/numerics.Numerics.held) maps the data pointer of a float32 array to (that array, the
# operand a GEMM takes for it): its bfloat16 bits (CuPy) or its values rounded to bfloat16 (NumPy).
def operand_copy(xp, a):
    """What the registry keeps for float32 array a converted once: its bits (CuPy), its rounded values (NumPy)."""
    return to_bf16_bits(xp, a) if xp.__name__ == "cupy" else _rounded(xp, a)


def _held_view(xp, a, held):
    """What a GEMM takes for float32 view a when its memory lies inside a held array: the same view of that
    array's bits (CuPy) or of its bfloat16 values (NumPy); None otherwise."""
    if not held or a.dtype != np.float32:
        return None
    lo, hi = gemm.span(a)
    for start, (values, operand) in held.items():
        if start <= lo and hi <= start + values.nbytes:
            off, rest = divmod(backend.data_ptr(a) - start, 4)
            if rest or any(st % 4 for st in a.strides):
                return None
            flat, item = operand.reshape(-1), operand.itemsize
            return xp.lib.stride_tricks.as_strided(flat[off:], a.shape, tuple(st // 4 * item for st in a.strides))
    return None


# An operand may also come as bfloat16 bits already (uint16, any view): a layer whose output only GEMMs read
# writes it so when the storage is packed (nn/numerics.Numerics.writes_bits), in its own kernel on CuPy, and the
# GEMM takes it as it is; NumPy multiplies the float32 values of those bits. `product_bits` gives a GEMM's output
# in bfloat16 bits too (cuBLAS writes CUDA_R_16BF, the bias added in float32 before the one rounding), for a
# layer whose consumers read bits (SwiGLU's and GELU's kernels, the rotary embedding, attention's products).
def product_bits(xp, a, b, bias=None, held=None):
    """CuPy: a @ b (+ bias, a bfloat16 value per column) as bfloat16 bits, bfloat16 operands and float32 sums
    (C = bias bits with beta 1 when there is a bias)."""
    out = xp.empty(a.shape[:-1] + b.shape[-1:], dtype=np.uint16)
    if bias is not None:
        out[...] = _bits(xp, bias, held)  # bias bits under every row: cuBLAS adds them (beta 1) before rounding
    calls, a16, b16 = _planned(xp, *(_bits(xp, x, held) for x in (a, b)), out)
    _launch(xp, calls, a16, b16, out, bias is not None)
    return out


def _plan(a16, b16, out):
    return gemm.plan(a16.shape, gemm.elements(a16), b16.shape, gemm.elements(b16), out.shape, gemm.elements(out))


def _planned(xp, a16, b16, out):
    """(cuBLAS calls, a16, b16) for out = a16 @ b16: the operands as they are, or copied contiguous when one has no
    unit stride in its matrix dims (out is one cuBLAS writes in place)."""
    calls = _plan(a16, b16, out)
    if calls is None:
        a16, b16 = xp.ascontiguousarray(a16), xp.ascontiguousarray(b16)
        calls = _plan(a16, b16, out)
    return calls, a16, b16


def _rounded(xp, a):
    return round_bf16_(xp, np.array(a, dtype=np.float32, copy=True))


def _values(xp, a, held):
    """NumPy: the bfloat16 values operand a stands for, as float32 (bits converted, held, or rounded)."""
    if a.dtype == np.uint16:
        return from_bf16_bits(xp, a)
    view = _held_view(xp, a, held)
    return _rounded(xp, a) if view is None else view


def _bits(xp, a, held):
    """CuPy: operand a as bfloat16 bits (bits as they are, held, or converted in one pass). A transposed view of
    contiguous storage (a weight's .T, the probabilities' swapaxes) is converted as that storage and seen
    transposed again, as the bits of a packed run are: a product takes the same cuBLAS call whichever storage,
    bits or float32 values, its operands come from."""
    if a.dtype == np.uint16:
        return a
    view = _held_view(xp, a, held)
    if view is not None:
        return view
    if a.ndim >= 2 and not a.flags.c_contiguous and a.swapaxes(-1, -2).flags.c_contiguous:
        return to_bf16_bits(xp, a.swapaxes(-1, -2)).swapaxes(-1, -2)
    return to_bf16_bits(xp, a)



# `launch_args` builds the cuBLAS arguments without a GPU, so the CPU tests emulate them in NumPy against
# CuPy's binding order.
def launch_args(calls, a_ptr: int, b_ptr: int, out_ptr: int, alpha_ptr: int, beta_ptr: int, handle: int,
                c_bits: bool = False) -> list:
    """The arguments of cublas.gemmStridedBatchedEx for each planned call, in CuPy's binding order: (handle,
    transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc,
    strideC, batchCount, computeType, algo). cuBLAS's A is b (bf16 bits, 2 bytes an element), its B is a,
    C the output (see gemm.plan): float32, or bfloat16 bits with c_bits."""
    ctype, citem = (CUDA_R_16BF, 2) if c_bits else (CUDA_R_32F, 4)
    return [(handle, c.transa, c.transb, c.m, c.n, c.k, alpha_ptr, b_ptr + 2 * c.a_off, CUDA_R_16BF, c.lda,
             c.stride_a, a_ptr + 2 * c.b_off, CUDA_R_16BF, c.ldb, c.stride_b, beta_ptr, out_ptr + citem * c.c_off,
             ctype, c.ldc, c.stride_c, c.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) for c in calls]


def _launch(xp, calls, a16, b16, out, accumulate):
    cublas = backend.cublas_module()
    one, beta = np.ones(1, np.float32), np.full(1, 1.0 if accumulate else 0.0, np.float32)
    for args in launch_args(calls, a16.data.ptr, b16.data.ptr, out.data.ptr, one.ctypes.data, beta.ctypes.data,
                            xp.cuda.device.get_cublas_handle(), out.dtype == np.uint16):
        cublas.gemmStridedBatchedEx(*args)
