"""The GPU branches of benchmarks/gpu_check's workers, run on the CPU through the CuPy stand-in
(emulated_cupy.py) at tiny sizes: hpengine's bf16 training worker for both model kinds (its CuPy backend, the
device name, the memory pool's high-water mark), the AdamW and pack bandwidth measurement of the bandwidth part
(hpengine.doctor.bandwidth: CuPy events, device copies), the attention worker (flash kernels in bf16, on bf16
bits and in float32), the documents worker (both kernel families with segment ids) and the muon worker, each
giving the result the table reads. What a device run would trip over in Python, it trips over here first."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import emulated_cupy
import numpy as np
import pytest

from hpengine.doctor import bandwidth as bw

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))      # the gpu_check modules import each other by name

import gpu_check_attention as ga  # noqa: E402
import gpu_check_hpengine as gh  # noqa: E402
import gpu_check_kernels as gk  # noqa: E402
import gpu_check_options as opts  # noqa: E402


@pytest.fixture
def device(monkeypatch):
    mod = emulated_cupy.install(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", mod)                 # the workers import cupy themselves
    monkeypatch.setattr(opts, "MODELS", opts.SMOKE_MODELS)        # GPU mode, smoke sizes
    monkeypatch.setattr(opts, "ATTN_SHAPE", opts.SMOKE_ATTN_SHAPE)
    monkeypatch.setattr(opts, "DOC_SHAPE", opts.SMOKE_DOC_SHAPE)
    return mod


def _args(**more):
    a = opts.parse(["--steps", "1", "--warmup-steps", "1", "--warmup-s", "0", "--bw-params", "4096",
                    "--bw-reps", "1", "--bw-inner", "1", "--attn-reps", "1"])
    for k, v in more.items():
        setattr(a, k, v)
    return a


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_the_training_worker_on_the_device(small_corpus, device, model):
    r = gh.worker_hpengine(_args(model=model, data=str(small_corpus)))
    assert r["backend"] == "cupy" and r["device"] == "CuPy stand-in"
    assert r["pool_peak_bytes"] > 0 and r["tokens_per_s"] > 0 and math.isfinite(r["last_loss"])
    assert any(e.startswith("flash_mma_") for e in device.launches)       # bf16 amp on flash attention


def test_the_bandwidth_worker_on_the_device(device):
    a = _args()
    xp, timer, name = bw.device_setup(False, "cpu")
    assert xp is device and isinstance(timer, bw.EventTimer)
    r = bw.measure(xp, timer, name, a.bw_params, a.bw_reps, a.bw_inner, a.pack_segments)
    assert r["device"] == "CuPy stand-in" and r["n_params"] == 4096
    assert {"adamw", "pack", "unpack", "copy", "pack_copy"} <= set(r["timings"])
    assert r["timings"]["copy"]["how"] in ("elementwise", "memcpy") and device.counts["memcpy"] > 0
    assert all(t["median_s"] >= 0 for t in r["timings"].values())


def test_the_attention_worker_on_the_device(device):
    r = ga.worker_attention(_args())
    checks = {v: r["variants"][v]["checks"] for v in r["variants"] if "checks" in r["variants"][v]}
    assert {"bf16", "bits", "float32"} <= set(checks), r["variants"]
    assert "not_available" not in r["variants"]["bf16"]                          # the tensor-core kernels ran
    assert any(k.startswith("flash_mma_") for k in r["variants"]["bf16"]["kernels"])
    for name in ("o", "dq", "dk", "dv"):        # three kernel families on the same bf16 inputs agree
        norms = [checks[v][name]["norm"] for v in ("bf16", "bits", "float32")]
        assert all(np.isfinite(norms)) and max(norms) - min(norms) <= 2e-2 * max(norms), (name, norms)


def test_the_documents_worker_on_the_device(device):
    """Both kernel families with segment ids (the stand-in's emulators) against causal: the first document's rows
    agree, the kernels ran, and the table judges them."""
    r = gk.worker_documents(_args())
    assert set(r["variants"]) == {"float32", "bf16"}
    for v in r["variants"].values():
        assert "error" not in v and v["agreement"] <= gk.DOC_RTOL and v["documents"]["fwd_bwd_ms"] > 0, v
    assert any(e.startswith("flash_mma_") for e in device.launches) and "flash_fwd_f32" in device.launches
    assert [row.status for row in gk.rows_documents(gk.doc_shape(_args()), r, False)] == ["PASS", "PASS"]


def test_the_muon_worker_on_the_device(device):
    r = gk.worker_muon(_args())
    assert r["matrices"] == 7 * opts.SMOKE_MODELS["llama"]["n_layers"] and r["agreement"] <= 1e-6
    assert all(v["ms"] > 0 for v in r["variants"].values()) and len(r["variants"]) == 2
    assert [row.status for row in gk.rows_muon(r, False)] == ["INFO", "INFO"]


def test_the_gpu_calibration_on_the_device(device, monkeypatch):
    from hpengine.planner import calibrate_gpu as cg
    monkeypatch.setattr(cg, "GEMM_SHAPES", ((32, 32, 32), (64, 64, 64), (128, 128, 128), (96, 64, 192)))
    monkeypatch.setattr(cg, "COPY_ELEMENTS", (1 << 12, 1 << 14, 1 << 16))
    monkeypatch.setattr(cg, "LAUNCH_CALLS", (20, 200))
    monkeypatch.setattr(cg, "_gemm_s", lambda cp, dev, m, k, n, dtype: cg._events(
        cp, dev, lambda: cp.matmul(cp.ones((min(m, 128), min(k, 128)), dtype=dtype),
                                   cp.ones((min(k, 128), min(n, 128)), dtype=dtype)), 1))
    out = cg.calibrate_gpu()
    assert "[cluster]" in out and "launch_us" in out and "mem_bw_gbs" in out, out
