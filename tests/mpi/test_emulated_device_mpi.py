"""Ranks on the CuPy stand-in device (tests/unit/emulated_cupy.py), sharing it, with MPI through the pinned host
staging of the GPU path (no CUDA-aware MPI): data parallel, sharding stage 3 (its per-block gathers) and a
1F1B pipeline train as on NumPy, each against the one-process NumPy run (float64, 1e-10), with the fused kernels
on as on a GPU (the stand-in emulates their C code); packed bf16 with tp and sequence parallelism, and a
zero-bubble pipeline, follows the same layout's NumPy run. This checks the staging and the device-side plumbing
of the collectives, not a GPU or a CUDA-aware MPI."""
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from helpers import LLAMA, assert_same, assert_same_params, config, need, run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import emulated_cupy  # noqa: E402 - the stand-in lives beside the unit tests that check it

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()
S = "strategy."
DEVICE = ["runtime.backend=cupy", "runtime.share_devices=true", "runtime.cuda_aware_mpi=false"]
LAYOUTS = {
    "dp": [f"{S}data_parallel.enable=true", f"{S}data_parallel.degree={N}"],
    "sharding3": [f"{S}sharding.enable=true", f"{S}sharding.degree={N}", f"{S}sharding.stage=3"],
    "pp_1f1b": ["model.n_layers=4", f"{S}pipeline.enable=true", f"{S}pipeline.degree={N}",
                f"{S}pipeline.micro_batches=4"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ranks_on_the_stand_in_device_train_like_one_numpy_process(corpus, monkeypatch, layout):
    need(N == 2, "two ranks sharing the stand-in device")
    shape = ["model.n_layers=4"] if layout == "pp_1f1b" else []
    want_l, want_p, _ = run(config(corpus, *shape, "runtime.backend=numpy"), MPI.COMM_SELF, steps=3)
    device = emulated_cupy.install(monkeypatch)
    got_l, got_p, eng = run(config(corpus, *LAYOUTS[layout], *DEVICE), WORLD, steps=3)
    assert {"layernorm_fwd_f64", "causal_softmax_f64", "softmax_bwd_f64"} <= set(device.launches)
    assert eng.be.name == "cupy" and eng.be.staging is not None and eng.be.staging.nbytes > 0   # MPI went via host
    assert_same(got_l, want_l)
    assert_same_params(got_p, want_p)
    eng.mesh.free()


BF16 = ["model.dtype=float32", f"{S}amp.enable=true", f"{S}amp.dtype=bfloat16", f"{S}amp.bf16_storage=packed"]
BITS_LAYOUTS = {
    "tp2_sp_llama": [*LLAMA, f"{S}tensor_parallel.enable=true", f"{S}tensor_parallel.degree={N}",
                     f"{S}tensor_parallel.sequence_parallel=true"],
    "pp2_zb1p_gpt": ["model.n_layers=4", f"{S}pipeline.enable=true", f"{S}pipeline.degree={N}",
                     f"{S}pipeline.micro_batches=4", f"{S}pipeline.schedule=zb1p"],
}
BITS_LAYOUTS["pp2_zb1p_gpt_flash"] = BITS_LAYOUTS["pp2_zb1p_gpt"] + ["model.attention=flash"]   # dqkv bits in the stash


@pytest.mark.parametrize("layout", list(BITS_LAYOUTS))
def test_bf16_bits_across_ranks_on_the_stand_in_follow_numpy(corpus, monkeypatch, layout):
    """Packed bf16 on the stand-in device, two ranks: sequence parallelism gathers the norms' bits, a zero-bubble W
    stash holds GEMM inputs as bits; training follows the same layout's packed NumPy run within float32 sums'
    order (the layers' kernels and cuBLAS emulated, bits entries included)."""
    need(N == 2, "two ranks sharing the stand-in device")
    want_l, want_p, _ = run(config(corpus, *BITS_LAYOUTS[layout], *BF16, "runtime.backend=numpy"), WORLD, steps=2)
    device = emulated_cupy.install(monkeypatch)
    got_l, got_p, eng = run(config(corpus, *BITS_LAYOUTS[layout], *BF16, *DEVICE), WORLD, steps=2)
    assert any(e.endswith(("_bf16", "_bf16i", "_bf16x", "_bf16o")) for e in device.launches), sorted(device.launches)
    np.testing.assert_allclose(np.asarray(got_l), np.asarray(want_l), rtol=2e-3, atol=2e-3)
    for n in want_p:
        np.testing.assert_allclose(got_p[n], want_p[n], rtol=2e-3, atol=2e-3, err_msg=n)
    eng.mesh.free()


def test_the_gpu_checks_two_rank_worker_on_the_stand_in(corpus, monkeypatch, tmp_path):
    """benchmarks/gpu_check's dp2 worker in GPU mode (smoke sizes) on the stand-in: every 2-rank variant reports,
    data parallel and sharding agree, the ranks reached MPI through host staging, and the NCCL variant falls back
    with the one-line reason (two ranks share the device)."""
    need(N == 2, "the worker is written for 2 ranks")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_check_hpengine as gh
    import gpu_check_options as opts
    mod = emulated_cupy.install(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", mod)
    monkeypatch.setattr(opts, "MODELS", opts.SMOKE_MODELS)
    a = opts.parse(["--steps", "1", "--warmup-steps", "1", "--warmup-s", "0", "--dp2-steps", "2"])
    a.data, a.result = str(corpus), None
    a.variants = "dp,sharding,mpi,nccl"           # "single" is the orchestrator's 1-rank run (mpiexec -n 1)
    out = WORLD.bcast(gh.worker_losses(a), root=0)
    v = out["variants"]
    assert set(v) == set(a.variants.split(",")) and not any("error" in r for r in v.values()), v
    for name in ("dp", "sharding"):
        assert v[name]["backend"] == "cupy" and all(b > 0 for b in v[name]["staged_bytes"]), v[name]
    assert max(abs(x - y) / abs(y) for x, y in zip(v["dp"]["losses"], v["sharding"]["losses"])) < 1e-5
    assert v["mpi"]["tokens_per_s"] > 0
    assert v["nccl"]["tokens_per_s"] > 0 and any("NCCL" in w or "nccl" in w for w in v["nccl"].get("warnings", []))
