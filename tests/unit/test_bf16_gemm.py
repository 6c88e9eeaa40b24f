"""GEMMs with bfloat16 operands and float32 accumulation (hpengine/nn/bf16_gemm.py) without a GPU: the
conversion to bf16 bits against ml_dtypes, the NumPy product against a float64 oracle on ml_dtypes-rounded
operands, the cuBLAS GemmStridedBatchedEx arguments emulated in NumPy (column-major, through the pointers
they carry) for the views attention multiplies, the conversion kernel's body compiled by nvcc, and the
engine routing every GEMM through it under bf16 amp only; the policy the layers are handed (nn/numerics.py)."""
from __future__ import annotations

import ctypes
import inspect
import re

import ml_dtypes
import numpy as np
import pytest
from cuda_bodies import compile_body
from mpi4py import MPI

from hpengine.device import bf16_bits, kernels
from hpengine.config.load import load_config
from hpengine.nn import OFF, Numerics, bf16_gemm, gemm
from hpengine.run.build import build


def bf16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _caller():
    """The frame that asked for a GEMM: the first outside nn/numerics.py (whose methods forward to bf16_gemm)."""
    return next(f for f in inspect.stack()[2:] if not f.filename.endswith("numerics.py"))


def test_bits_equal_ml_dtypes():
    rng = np.random.default_rng(0)
    u = rng.integers(0, 2**32, size=500_000, dtype=np.uint64).astype(np.uint32)
    u = np.concatenate([u, np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x7F7FFFFF, 0x00008000,
                                     0x3F808000, 0x3F818000, 0x80000000, 0], np.uint32)])
    x = u.view(np.float32)
    got = bf16_bits.bf16_bits_numpy(x)
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    back = (got.astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(back[nan]).all()                       # a NaN stays a NaN, never inf


@pytest.mark.parametrize("accumulate", [False, True])
def test_numpy_product_is_bf16_operands_float32_sums(accumulate):
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(3, 17, 40)).astype(np.float32), rng.normal(size=(3, 40, 9)).astype(np.float32)
    out = rng.normal(size=(3, 17, 9)).astype(np.float32)
    start = out.copy()
    bf16_gemm.matmul(np, a, b, out, accumulate)
    oracle = bf16(a).astype(np.float64) @ bf16(b).astype(np.float64) + (start if accumulate else 0)
    np.testing.assert_allclose(out, oracle, rtol=2e-6, atol=2e-6)
    assert not np.allclose(a.astype(np.float64) @ b, oracle, rtol=1e-5, atol=1e-5)   # the rounding shows
    assert bf16_gemm.matmul(np, a, b).dtype == np.float32


class Memory:
    """Pointers the cuBLAS arguments carry, mapped back to the NumPy buffers they point into."""

    def __init__(self, *bufs):
        self.bufs = bufs

    def at(self, ptr: int, itemsize: int):
        for buf in self.bufs:
            base = buf.__array_interface__["data"][0]
            if base <= ptr < base + buf.nbytes:
                assert (ptr - base) % itemsize == 0 and buf.itemsize == itemsize
                return buf, (ptr - base) // itemsize
        raise AssertionError(f"pointer {ptr:#x} outside every buffer")


def _matrix(flat, off, rows, cols, ld, stored):
    i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return flat[off + i + j * ld] if stored else off + i + j * ld


def emulate_ex(args, mem: Memory):
    """cublasGemmStridedBatchedEx in NumPy: bf16 A and B (uint16 bits), float32 C, float32 compute."""
    for (handle, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc, batch, comp,
         algo) in args:
        assert (at, bt, ct, comp) == (bf16_gemm.CUDA_R_16BF, bf16_gemm.CUDA_R_16BF, bf16_gemm.CUDA_R_32F,
                                      bf16_gemm.CUBLAS_COMPUTE_32F)
        alpha_v, beta_v = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
        abuf, aoff = mem.at(A, 2)
        bbuf, boff = mem.at(B, 2)
        cbuf, coff = mem.at(C, 4)
        af, bf, cf = (abuf.reshape(-1).astype(np.uint32) << 16).view(np.float32), \
            (bbuf.reshape(-1).astype(np.uint32) << 16).view(np.float32), cbuf.reshape(-1)
        for t in range(batch):
            Am = _matrix(af, aoff + t * sa, *((m, k) if ta == gemm.N else (k, m)), lda, True)
            Bm = _matrix(bf, boff + t * sb, *((k, n) if tb == gemm.N else (n, k)), ldb, True)
            Am, Bm = (Am if ta == gemm.N else Am.T), (Bm if tb == gemm.N else Bm.T)
            ic = _matrix(None, coff + t * sc, m, n, ldc, False)
            cf[ic] = alpha_v * (Am.astype(np.float64) @ Bm) + beta_v * cf[ic]



CASES = {
    # (a view, b view, out view) as attention and the linears take them
    "linear": lambda r: (r.normal(size=(24, 16)), r.normal(size=(16, 48)), None),
    "weight_grad_transposed": lambda r: (r.normal(size=(24, 16)).T, r.normal(size=(24, 48)), None),
    "heads_qk": lambda r: (lambda v: (v[:, :, :, 0].transpose(0, 2, 1, 3),
                                      v[:, :, :, 1].transpose(0, 2, 1, 3).swapaxes(-1, -2), None))(
        r.normal(size=(2, 8, 3 * 3 * 4)).reshape(2, 8, 3, 3, 4)),
    "pv_into_strided_out": lambda r: (r.normal(size=(2, 3, 8, 8)), r.normal(size=(2, 3, 8, 4)),
                                      np.zeros((2, 8, 3, 4), np.float32).transpose(0, 2, 1, 3)),
}


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_cublas_ex_arguments_emulated(case, accumulate):
    rng = np.random.default_rng(2)
    a, b, out = CASES[case](rng)
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if out is None:
        out = np.zeros(a.shape[:-1] + b.shape[-1:], np.float32)
    out[...] = rng.normal(size=out.shape)
    start = out.copy()
    a16, b16 = bf16_bits.bf16_bits_numpy(a), bf16_bits.bf16_bits_numpy(b)     # contiguous, as on the GPU
    calls = gemm.plan(a16.shape, gemm.elements(a16), b16.shape, gemm.elements(b16), out.shape, gemm.elements(out))
    assert calls is not None
    one, beta = np.ones(1, np.float32), np.full(1, 1.0 if accumulate else 0.0, np.float32)
    base = out.base if out.base is not None else out
    args = bf16_gemm.launch_args(calls, a16.ctypes.data, b16.ctypes.data, out.ctypes.data, one.ctypes.data,
                                 beta.ctypes.data, 7)
    assert all(len(x) == 23 and x[0] == 7 for x in args)
    emulate_ex(args, Memory(a16, b16, base))
    want = bf16(a).astype(np.float64) @ bf16(b) + (start if accumulate else 0)
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)


@pytest.mark.skipif(kernels.find_nvcc() is None, reason="nvcc not installed")
def test_conversion_body_compiles(tmp_path):
    log = compile_body(tmp_path, "to_bf16", "const float* xs, unsigned short* ys",
                       "    float x = xs[i];\n    unsigned short y;\n" + bf16_bits.TO_BF16_BODY + "    ys[i] = y;\n")
    assert re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log) == [("0", "0")], log


def test_policies_are_values():
    # OFF stores nothing and holds nothing; each bf16 policy made owns its registry, which its float32_out
    # twin shares
    assert not OFF.bf16 and not OFF.stores and not OFF.writes_bits and OFF.held is None and OFF.float32_out is OFF
    a, b = Numerics(bf16=True, bits=True), Numerics(bf16=True, bits=True)
    assert a.held is not b.held and a.writes_bits and a.stores
    f = a.float32_out
    assert f.bf16 and not f.stores and not f.writes_bits and f.held is a.held and f.float32_out is f
    assert not Numerics(bf16=False, bits=True).writes_bits


@pytest.mark.parametrize("amp", [[], ["strategy.amp.enable=true", "strategy.amp.dtype=float16"],
                                 ["strategy.amp.enable=true", "strategy.amp.dtype=bfloat16"]])
def test_engine_routes_gemms_only_under_bf16(monkeypatch, amp):
    calls = []
    real = bf16_gemm.matmul
    monkeypatch.setattr(bf16_gemm, "matmul", lambda *a, **k: calls.append(_caller().filename) or real(*a, **k))
    cfg = load_config(None, ["model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.seq_len=8",
                             "train.global_batch=4", "runtime.backend=numpy", "model.dtype=float32", *amp])
    eng = build(cfg, MPI.COMM_SELF)
    eng.train_step(0)
    bf = "strategy.amp.dtype=bfloat16" in amp
    # the linears: 4 a layer and the head's, 3 GEMMs each; attention: 2 forward and 4 backward per query block
    linear = sum(f.endswith("linear.py") for f in calls)     # (a stored output too: num.product_stored)
    attention = sum(f.endswith("attention.py") for f in calls)
    assert (linear, len(calls) - linear - attention) == ((2 * 4 + 1) * 3 if bf else 0, 0)
    assert (attention > 0 and attention % (2 * 6) == 0) if bf else attention == 0
    assert eng.ctx.num is eng.precision.numerics and eng.ctx.num.bf16 == bf


def test_held_operands_give_the_products_of_unheld_ones():
    # a gradient read by two products (a linear's weight and input gradients), converted once inside held:
    # the same bits as each product rounding it itself; a view of a held array (a slice, a transpose) too
    rng = np.random.default_rng(5)
    dy, x, w = (rng.normal(size=s).astype(np.float32) for s in ((12, 6), (12, 4), (4, 6)))
    num = Numerics(bf16=True)
    want = (num.matmul(np, x.T, dy), num.matmul(np, dy, w.T), num.matmul(np, dy[3:9].T, x[3:9]))
    with num.converted(np, dy):
        assert bf16_gemm._held_view(np, dy[3:9].T, num.held) is not None
        got = (num.matmul(np, x.T, dy), num.matmul(np, dy, w.T), num.matmul(np, dy[3:9].T, x[3:9]))
    assert not num.held
    for g, w_ in zip(got, want):
        np.testing.assert_array_equal(g, w_)
    with OFF.converted(np, dy):                       # outside bf16 amp nothing is held
        assert OFF.held is None


@pytest.mark.parametrize("view", ["plain", "transposed", "sliced"])
def test_bits_operands_are_their_values(view):
    # an operand handed over as bfloat16 bits (a layer that writes what only GEMMs read): the product of the
    # values those bits hold, against float64 on ml_dtypes-rounded operands
    rng = np.random.default_rng(6)
    a, b = rng.normal(size=(20, 12)).astype(np.float32), rng.normal(size=(12, 7)).astype(np.float32)
    bits = bf16_bits.bf16_bits_numpy(a)
    a_op, bits_op = {"plain": (a, bits), "transposed": (a.T.copy().T, bits.T.copy().T),
                     "sliced": (a[::2], bits[::2])}[view]
    got = bf16_gemm.matmul(np, bits_op, b)
    np.testing.assert_array_equal(got, bf16_gemm.matmul(np, a_op, b))
    np.testing.assert_allclose(got, bf16(a_op).astype(np.float64) @ bf16(b), rtol=2e-6, atol=2e-6)
    with pytest.raises(TypeError, match="float32 values or uint16 bits"):
        bf16_gemm.matmul(np, a.astype(np.float64), b)


def test_store_for_gemm_follows_the_storage():
    x = np.float32([1.0 + 2.0**-9, 1.0 + 3 * 2.0**-9, -3.0e38, np.inf])    # two ties (to even), a large, inf
    want = np.float32([1.0, 1.0 + 2.0**-7, -3.0e38, np.inf]).astype(ml_dtypes.bfloat16)
    assert OFF.store_for_gemm(np, x) is x                                   # outside bf16 amp: as it is
    packed = Numerics(bf16=True, bits=True)
    assert packed.writes_bits
    got = packed.store_for_gemm(np, x.copy())
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, want.view(np.uint16))
    assert packed.store_for_gemm(np, got) is got                            # bits already
    assert packed.float32_out.store_for_gemm(np, x) is x                    # a float32 reader: as it is
    rounded = Numerics(bf16=True)                                           # float32 storage: rounded in place
    assert not rounded.writes_bits
    y = x.copy()
    assert rounded.store_for_gemm(np, y) is y
    np.testing.assert_array_equal(y, want.astype(np.float32))
    assert not Numerics(bf16=False, bits=True).writes_bits


@pytest.mark.parametrize("storage,kind", [("packed", "llama"), ("packed", "gpt"), ("float32", "llama")])
def test_linears_read_their_inputs_as_bits_when_packed(monkeypatch, storage, kind):
    # packed, the inputs only GEMMs read (the norms' outputs, the MLP's gating or GELU, the grouped attention's
    # output) reach the linears as bfloat16 bits
    seen = []
    real = bf16_gemm.matmul
    monkeypatch.setattr(bf16_gemm, "matmul", lambda xp, a, b, *r, **k: (
        seen.append((_caller().function, a.dtype)) or real(xp, a, b, *r, **k)))
    L = 2
    cfg = load_config(None, ["model.d_model=16", f"model.n_layers={L}", "model.n_heads=2", "model.seq_len=8",
                             f"model.kind={kind}", "train.global_batch=4", "runtime.backend=numpy",
                             "model.dtype=float32", "strategy.amp.enable=true", "strategy.amp.dtype=bfloat16",
                             f"strategy.amp.bf16_storage={storage}"])
    build(cfg, MPI.COMM_SELF).train_step(0)
    fwd = [dt for fn, dt in seen if fn == "linear_forward"]
    bits = sum(dt == np.uint16 for dt in fwd)
    # a layer's linears, all reading bits (the o and attn.proj projections the attention's output): llama q, k,
    # v, o, gate, up and down; gpt qkv, attn.proj, fc and proj; the head's one
    linears, per_layer = {"llama": (7, 7), "gpt": (4, 4)}[kind]
    assert len(fwd) == L * linears + 1
    assert bits == (L * per_layer + 1 if storage == "packed" else 0)


@pytest.mark.parametrize("bias", [False, True])
def test_product_stored_rounds_once_with_its_bias(monkeypatch, bias):
    # a GEMM output stored in bfloat16 (cuBLAS writing CUDA_R_16BF, the bias as C with beta 1, on the stand-in
    # device; NumPy's twin): the bits of round(a @ b + bias) over bfloat16 operands, one rounding, against
    # float64 on ml_dtypes-rounded operands
    import emulated_cupy
    dev = emulated_cupy.install(monkeypatch)
    rng = np.random.default_rng(8)
    a, b = rng.normal(size=(24, 16)).astype(np.float32), rng.normal(size=(16, 40)).astype(np.float32)
    c = bf16(rng.normal(size=40)) if bias else None
    exact = bf16(a).astype(np.float64) @ bf16(b) + (0 if c is None else c)
    gemms = emulated_cupy.LAUNCHES["cublas:gemmStridedBatchedEx"]
    packed = Numerics(bf16=True, bits=True)
    host = packed.product_stored(np, a, b, c)
    got = packed.product_stored(dev, dev.asarray(a), dev.asarray(b), None if c is None else dev.asarray(c))
    assert isinstance(got, dev.ndarray) and got.dtype == host.dtype == np.uint16
    got = got.get()
    assert emulated_cupy.LAUNCHES["cublas:gemmStridedBatchedEx"] == gemms + 1
    # within one bfloat16 step of the exact sum's rounding (float32 sums in either order), equal in most places
    values = (got.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_allclose(values, exact, rtol=2**-7, atol=1e-6)
    assert np.mean(got == host) > 0.95 and np.mean(got == bf16_bits.bf16_bits_numpy(exact)) > 0.95
    # float32 storage: the same values, rounded in float32
    np.testing.assert_array_equal(Numerics(bf16=True).product_stored(np, a, b, c),
                                  (host.astype(np.uint32) << 16).view(np.float32))
