"""bf16-operand GEMMs on the GPU (nn/bf16_gemm.py: bf16 bits, cublasGemmStridedBatchedEx with float32
compute) against the NumPy twin (rounded operands, float32 BLAS): the conversion bit for bit, the products
to float32 rounding, for the views the linears and attention multiply, written and accumulated; and a
bf16 amp step on CuPy against the same step on NumPy. Skips cleanly without CuPy and a device."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from hpengine.device import backend, bf16_bits
from hpengine.device.precision import round_bf16_
from hpengine.config.load import load_config
from hpengine.nn import bf16_gemm
from hpengine.run.build import build

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")


def test_conversion_bit_for_bit():
    cp = backend.cupy_module()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x.reshape(1024, 1024)[:, ::2]                                    # a strided view
    got = cp.asnumpy(bf16_bits.to_bf16_bits(cp, cp.asarray(x)))
    np.testing.assert_array_equal(got, bf16_bits.bf16_bits_numpy(x))


def test_rounding_in_place_bit_for_bit():
    """precision.round_bf16_ on CuPy (one kernel) against its NumPy path: every bit, NaNs included, on a
    strided view whose other elements stay untouched."""
    cp = backend.cupy_module()
    rng = np.random.default_rng(1)
    x = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    x[:4] = (0x7F800000, 0xFF800001, 0x00008000, 0x3F818000)            # inf, a NaN, ties to even both ways
    x = x.view(np.float32).reshape(1024, 1024)
    dev = cp.asarray(x)
    round_bf16_(cp, dev[:, ::2])
    want = x.copy()
    round_bf16_(np, want[:, ::2])
    np.testing.assert_array_equal(cp.asnumpy(dev).view(np.uint32), want.view(np.uint32))


VIEWS = {
    "linear": lambda r: (r.normal(size=(512, 256)), r.normal(size=(256, 768)), None),
    "weight_grad": lambda r: (r.normal(size=(512, 256)).T, r.normal(size=(512, 768)), None),
    "heads": lambda r: (lambda v: (v[:, :, :, 0].transpose(0, 2, 1, 3),
                                   v[:, :, :, 1].transpose(0, 2, 1, 3).swapaxes(-1, -2), None))(
        r.normal(size=(2, 128, 4 * 3 * 32)).reshape(2, 128, 4, 3, 32)),
}


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("case", list(VIEWS))
def test_products_equal_the_numpy_twin(case, accumulate):
    cp = backend.cupy_module()
    rng = np.random.default_rng(1)
    a, b, _ = VIEWS[case](rng)
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    out = rng.normal(size=a.shape[:-1] + b.shape[-1:]).astype(np.float32)
    want = bf16_gemm.matmul(np, a, b, out.copy(), accumulate)
    da, db = cp.asarray(a), cp.asarray(b)                      # contiguous copies: the views are rebuilt below
    if case == "weight_grad":
        da = cp.asarray(a.T).T
    dout = cp.asarray(out)
    got = cp.asnumpy(bf16_gemm.matmul(cp, da, db, dout, accumulate))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_bf16_amp_step_on_cupy_equals_numpy(small_corpus):
    base = [f"data.path={small_corpus}", "train.eval_every=0", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64", "train.global_batch=4",
            "model.dtype=float32", "strategy.amp.enable=true", "strategy.amp.dtype=bfloat16"]
    losses = {}
    for be in ("numpy", "cupy"):
        eng = build(load_config(None, base + [f"runtime.backend={be}"]), MPI.COMM_SELF)
        losses[be] = [eng.train_step(s)["loss"] for s in range(3)]
    np.testing.assert_allclose(losses["cupy"], losses["numpy"], rtol=2e-3)
