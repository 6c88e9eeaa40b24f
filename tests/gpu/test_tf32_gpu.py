"""runtime.matmul_precision = "tf32": float32 GEMMs (the strided cuBLAS path of nn/gemm.py and cupy.matmul)
run with TF32 inputs: their error against float64 grows from float32's ~1e-6 to TF32's ~1e-3 relative, and
stays there. Skips cleanly without CuPy and a device."""
from __future__ import annotations

import numpy as np
import pytest

from hpengine.device import backend
from hpengine.nn import gemm

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")


def rel_err(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_tf32_engages_and_stays_accurate():
    be = backend.Backend("cupy", "float32")
    cp = be.xp
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((512, 768)), rng.standard_normal((768, 640))
    want = a @ b
    da, db = cp.asarray(a, dtype=cp.float32), cp.asarray(b, dtype=cp.float32)
    handle = cp.cuda.device.get_cublas_handle()
    cublas = backend.cublas_module()
    before = cublas.getMathMode(handle)
    try:
        assert be.set_matmul_precision("highest") == "highest"
        full = [rel_err(cp.asnumpy(f(da, db)), want) for f in (cp.matmul, lambda x, y: gemm.matmul(cp, x, y.T.T))]
        assert be.set_matmul_precision("tf32") == "tf32"
        tf = [rel_err(cp.asnumpy(f(da, db)), want) for f in (cp.matmul, lambda x, y: gemm.matmul(cp, x, y.T.T))]
    finally:
        cublas.setMathMode(handle, before)
    assert max(full) < 1e-5
    assert all(1e-5 < e < 1e-2 for e in tf), (full, tf)
