"""bfloat16 activation caches in 2 bytes on the GPU (strategies/bf16_storage.py through device/bf16_bits.py's
kernels) against the NumPy twin: the bits and the round trip of strided views bit for bit, and a bf16 amp run
on CuPy whose caches are packed (auto on a GPU) training like the float32 storage of the same values on CuPy
(bit for bit on the stand-in, within float32 sums' order on a device: same_training), with device arrays of uint16 bits in its caches and a lower cache peak, and so with bfloat16
gradients packed too. Skips cleanly without CuPy and a device."""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.device import backend
from hpengine.layout.cache import cache_arrays
from hpengine.run.build import build
from hpengine.strategies.bf16_storage import Packed, pack_cache, unpack_cache


def same_training(la, pa, lb, pb):
    """Two storages' runs: bit for bit where every cuBLAS call is emulated (the stand-in: the same products in the
    same layouts); on a device the packed run's GEMMs that write bfloat16 (CUDA_R_16BF outputs, where the
    float32 storage writes float32 and rounds) may run other cuBLAS kernels, so float32 sums in another order:
    within a few bfloat16 steps there."""
    if os.environ.get("HPENGINE_STANDIN") == "1":
        assert la == lb and all(np.array_equal(pa[n], pb[n]) for n in pa)
        return
    np.testing.assert_allclose(la, lb, rtol=1e-3)
    for n in pa:
        np.testing.assert_allclose(pa[n], pb[n], rtol=2**-6, atol=1e-4, err_msg=n)

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")


def test_pack_and_unpack_equal_the_numpy_twin():
    cp = backend.cupy_module()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, size=(64, 3 * 96), dtype=np.uint64).astype(np.uint32).view(np.float32).copy()
    cache = lambda a: (a[:, :96], a[:, 96:192], a[:, 192:].T, a.reshape(-1))        # noqa: E731
    want = pack_cache(np, cache(x), set())
    got = pack_cache(cp, cache(cp.asarray(x)), set())
    np.testing.assert_array_equal(cp.asnumpy(got[0].base.bits), want[0].base.bits)
    back_np, back_cp = unpack_cache(np, want), unpack_cache(cp, got)
    for a, b in zip(cache_arrays(back_cp), cache_arrays(back_np)):
        assert a.shape == b.shape and a.dtype == np.float32
        np.testing.assert_array_equal(cp.asnumpy(a).view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("attention", ["standard", "flash"])
def test_packed_run_on_cupy_equals_float32_storage(small_corpus, attention):
    """Packed and float32 storage train alike (same_training); under flash the attention takes qkv and gives
    dqkv as bits, packed."""
    base = [f"data.path={small_corpus}", "train.eval_every=0", "model.d_model=64", "model.n_layers=2",
            "model.n_heads=4", "model.seq_len=64", "train.global_batch=4", "model.dtype=float32",
            "strategy.amp.enable=true", "strategy.amp.dtype=bfloat16", "runtime.backend=auto",
            f"model.attention={attention}"]
    out = {}
    for mode in ("float32", "auto"):
        eng = build(load_config(None, base + [f"strategy.amp.bf16_storage={mode}"]), MPI.COMM_SELF)
        assert eng.be.is_gpu and eng.precision.packed == (mode == "auto")
        losses = [eng.train_step(s)["loss"] for s in range(3)]
        out[mode] = (losses, eng.named_params(), eng.cache_peak, eng)
    (la, pa, ka, _), (lb, pb, kb, eng) = out["float32"], out["auto"]
    same_training(la, pa, lb, pb)
    assert kb < ka
    slot = eng.slots[0]
    b = eng.rows.read("train", 0, slot.seed).row_slice(0, 2)
    _, caches = eng.chunk_forward(slot, slot.chunks[0], b.tokens, b, 1.0)   # the context hands the layers bf16
    held = [a for a in cache_arrays(caches[1:-1]) if isinstance(a, Packed)]
    cp = backend.cupy_module()
    assert held and all(isinstance(a.bits, cp.ndarray) and a.bits.dtype == np.uint16 for a in held)
    if attention == "flash":                # the attention's qkv and output were bits already: kept as they are
        qkv, y = caches[1][2][:2]
        assert isinstance(qkv, cp.ndarray) and qkv.dtype == np.uint16 and y.dtype == np.uint16
    eng.chunk_backward(slot, slot.chunks[0], None, caches)


def test_packed_gradients_on_cupy_equal_float32_storage(small_corpus):
    """amp.grad_dtype = "bfloat16" with a tied head and two passes a step: the packed run's gradients at rest
    are device bits in half the bytes and it trains bit for bit like the float32 storage on CuPy."""
    base = [f"data.path={small_corpus}", "train.eval_every=0", "model.d_model=64", "model.n_layers=2",
            "model.n_heads=4", "model.seq_len=64", "train.global_batch=4", "model.dtype=float32",
            "model.tie_head=true", "strategy.amp.enable=true", "strategy.amp.dtype=bfloat16",
            "strategy.amp.grad_dtype=bfloat16", "strategy.gradient_merge.enable=true",
            "strategy.gradient_merge.k_steps=2", "runtime.backend=auto"]
    out = {}
    for mode in ("float32", "auto"):
        eng = build(load_config(None, base + [f"strategy.amp.bf16_storage={mode}"]), MPI.COMM_SELF)
        assert eng.be.is_gpu and eng.sync.storage.encoded == (mode == "auto")
        losses = [eng.train_step(s)["loss"] for s in range(3)]
        out[mode] = (losses, eng.named_params(), eng)
    (la, pa, ea), (lb, pb, eb) = out["float32"], out["auto"]
    same_training(la, pa, lb, pb)
    cp = backend.cupy_module()
    g = eb.sync.grads.data
    assert isinstance(g, cp.ndarray) and g.dtype == np.uint16
    assert 2 * eb.memory()["grad_bytes"] == ea.memory()["grad_bytes"]
