"""GPU parity: every RawKernel against its NumPy twin (bit for bit, over aligned and misaligned views and
subnormal values), the optimizer on CuPy against NumPy, host staging, kernel build errors at the .cu line,
and a few float64 training steps on CuPy against NumPy. Skips cleanly without CuPy and a CUDA device.
"""
from __future__ import annotations

import numpy as np
import pytest

from hpengine.device import backend
from hpengine.device import kernels
from hpengine.dist import comm
from hpengine.doctor.parity import adamw_inputs     # gradients and moments down to subnormals
from hpengine.params.buffers import Layout, ParamSpec, Range
from hpengine.optim import AdamW

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")
cp = backend.cupy_module() if backend.cupy_usable() else None


def on_device(a, offset: int = 0):
    """A device copy of host array a starting `offset` elements past a fresh (256-byte aligned)
    allocation, so the kernels see every alignment."""
    out = cp.empty(a.size + offset, dtype=a.dtype)[offset:]
    out.set(np.ascontiguousarray(a))
    return out


def same_bits(dev, host) -> bool:
    return cp.asnumpy(dev).tobytes() == np.ascontiguousarray(host).tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 1000, 65_537, 1_000_003])
@pytest.mark.parametrize("offs", [(0, 0, 0, 0), (1, 1, 1, 1), (3, 3, 0, 0), (0, 1, 2, 3)])
def test_adamw_kernel_equals_twin(dtype, n, offs):
    rng = np.random.default_rng(n)
    p, g, m, v, mask = adamw_inputs(rng, n, dtype)
    dp, dg, dm, dv = (on_device(a, o) for a, o in zip((p, g, m, v), offs))
    dmask = on_device(mask, offs[0])
    for t, (lr, coef) in enumerate([(1e-3, 1.0), (3e-3, 0.31), (0.0, 1 / 65536)], start=1):
        c = kernels.adamw_coefs(t, lr, (0.9, 0.95), 1e-8, 0.1, coef)
        kernels.adamw_numpy(p, g, m, v, mask, c)
        kernels.adamw(dp, dg, dm, dv, dmask, c)
        cp.cuda.get_current_stream().synchronize()
        assert same_bits(dp, p) and same_bits(dm, m) and same_bits(dv, v), f"step {t}"


@pytest.mark.parametrize("copy", [np.float16, np.float32, np.uint16])
@pytest.mark.parametrize("n", [1, 7, 4096, 100_003])
@pytest.mark.parametrize("off", [0, 2])
def test_adamw_copy_kernel_equals_twin(copy, n, off):
    """amp's compute copy written in the update's pass: float16 (adamw_f32_half), float32 holding bf16
    values (adamw_f32_bf16) or their bits (adamw_f32_bf16bits), bit for bit the twin's."""
    rng = np.random.default_rng(7)
    p, g, m, v, mask = adamw_inputs(rng, n, np.float32)
    p *= 1e3 if copy == np.float16 else 10.0 ** rng.integers(-30, 30, n)    # rounding at scale / across exponents
    dp, dg, dm, dv, dmask = (on_device(a, off) for a in (p, g, m, v, mask))
    host, dev = np.empty(n, copy), on_device(np.zeros(n, copy), off)
    c = kernels.adamw_coefs(1, 1e-3, (0.9, 0.999), 1e-8, 0.01, 0.5)
    kernels.adamw_numpy(p, g, m, v, mask, c, host)
    kernels.adamw(dp, dg, dm, dv, dmask, c, dev)
    assert same_bits(dp, p) and same_bits(dev, host)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("r", [Range(0, 150_000), Range(13, 150_001), Range(40_001, 40_010)])
def test_optimizer_on_cupy_equals_numpy(dtype, r):
    specs = [ParamSpec(f"t{i}", (n,), decay=(i % 2 == 0)) for i, n in enumerate([40_000, 7, 30_001, 80_000])]
    layout, rng = Layout(specs), np.random.default_rng(3)
    host = AdamW(np, layout, r, dtype, (0.9, 0.95), 1e-8, 0.1)
    dev = AdamW(cp, layout, r, dtype, (0.9, 0.95), 1e-8, 0.1)
    assert dev.fused and not host.fused
    flat = rng.standard_normal(layout.total).astype(dtype)
    dflat, dgrad = on_device(flat), cp.zeros(layout.total, dtype=dtype)
    for lr in (1e-3, 2e-3, 5e-4):
        grad = rng.standard_normal(layout.total).astype(dtype)
        dgrad.set(grad)
        host.step(flat[r.slice], grad[r.slice], lr, 0.7)
        dev.step(dflat[r.slice], dgrad[r.slice], lr, 0.7)
    assert dev.m.data.ptr % 16 == dflat[r.slice].data.ptr % 16      # moments realigned for vector loads
    assert same_bits(dflat, flat) and same_bits(dev.m, host.m) and same_bits(dev.v, host.v)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("off", [0, 1, 3])
def test_pack_unpack_kernels_equal_twins(dtype, off):
    rng = np.random.default_rng(5)
    src = rng.standard_normal(3_000_000).astype(dtype)
    so, ss = kernels.strided_segments(1_000_001, rows=300, cols=129, ld=1000)
    offs = [0, 300_005, 2_999_999, 300_017, 400_000] + list(so)   # disjoint, so unpack is defined
    sizes = [300_000, 0, 1, 3, 599_999] + list(ss)
    n = int(np.sum(sizes))
    dsrc, dbuf = on_device(src, off), on_device(np.zeros(n + 5, dtype), (off + 1) % 4)
    buf = kernels.pack(np.zeros(n + 5, dtype), src, offs, sizes)
    kernels.pack(dbuf, dsrc, offs, sizes)
    assert same_bits(dbuf, buf)
    dst, ddst = np.zeros_like(src), on_device(np.zeros_like(src), off)
    kernels.unpack(buf, dst, offs, sizes)
    kernels.unpack(dbuf, ddst, offs, sizes)
    assert same_bits(ddst, dst)


@pytest.mark.parametrize("off", [0, 1])
def test_pack_bf16_kernel_equals_twin(off):
    rng = np.random.default_rng(6)
    src = rng.integers(0, 2**16, 200_000, dtype=np.uint16)
    offs, sizes = [0, 7, 150_003, 199_999, 60_000], [5, 0, 40_000, 1, 768]
    n = int(np.sum(sizes))
    buf = kernels.pack_bf16(np.zeros(n + 3, np.float32), src, offs, sizes)
    dbuf = on_device(np.zeros(n + 3, np.float32), off)
    kernels.pack_bf16(dbuf, on_device(src, (off + 1) % 2), offs, sizes)
    assert same_bits(dbuf, buf)


def test_kernel_build_error_names_the_cu_line(tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void broken_f32(float* p) {\n    p[0] = 1.0f;\n    p[1] = nope;\n}\n')
    with pytest.raises(kernels.KernelError) as e:
        kernels.function("broken", "broken_f32", path=bad)
    assert f"{bad}(3)" in str(e.value)


def test_host_staging_round_trip_and_mpi():
    from mpi4py import MPI
    be = backend.make_backend("cupy", "float32", cuda_aware=False)
    assert be.is_gpu and not be.cuda_aware
    a = cp.arange(10, dtype=cp.float32)
    host = be.stage_out(a)
    assert isinstance(host, np.ndarray) and (host == np.arange(10)).all()
    assert np.shares_memory(be.stage_out(a), host)                 # the pinned mirror is reused
    MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
    host *= 2
    be.stage_in(host, a)
    assert same_bits(a, 2 * np.arange(10, dtype=np.float32))


def test_cuda_aware_mpi_takes_device_buffers():
    if not comm.mpi_cuda_support():
        pytest.skip("this MPI library does not report CUDA support")
    from mpi4py import MPI
    be = backend.make_backend("cupy", "float32", cuda_aware=comm.mpi_cuda_support())
    a = cp.arange(10, dtype=cp.float32)
    assert be.stage_out(a) is a                                    # stage_out has synchronised
    out = cp.zeros_like(a)
    be.sync()
    MPI.COMM_SELF.Allreduce(a, out, op=MPI.SUM)
    assert same_bits(out, np.arange(10, dtype=np.float32))


@pytest.mark.timeout(600)
def test_float64_training_on_cupy_equals_numpy(tmp_path, small_corpus):
    import json

    from hpengine.config.load import load_config
    from hpengine.run.train import train
    common = ["model.kind='gpt'", "model.seq_len=16", "model.d_model=32", "model.n_layers=2",
              "model.n_heads=2", "model.dtype='float64'", "train.global_batch=4", "train.steps=4",
              "train.eval_every=0", "optim.clip_grad_norm=1.0", f"data.path={small_corpus}"]
    losses = {}
    for kind in ("numpy", "cupy"):
        out = tmp_path / kind
        train(load_config(None, common + [f"runtime.backend='{kind}'", f"train.out_dir={out}"]))
        losses[kind] = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    # cuBLAS sums in another order than the CPU BLAS: equal to float64 rounding, not bit for bit
    assert losses["cupy"] == pytest.approx(losses["numpy"], rel=1e-10, abs=0)
