"""The deepseek kind with flash attention on the CuPy stand-in (tests/unit/emulated_cupy.py) with the kernels on:
MLA's values, narrower than its queries and keys, reach the flash kernels zero-padded (nn/flash_cuda.py), and
training equals the NumPy run (float64 to 1e-10; bf16 amp over packed storage, the tensor-core entries, as
test_emulated_device.py judges two bf16 runs)."""
from __future__ import annotations

import emulated_cupy
import pytest
from test_emulated_device import BF16, _same, _same_amp, train, train_amp

DS = ["model.kind=deepseek", "model.ffn_hidden=48", "model.mla.q_lora_rank=12", "model.mla.kv_lora_rank=16",
      "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6",
      "model.attention=flash"]


@pytest.fixture
def device(monkeypatch):
    return emulated_cupy.install(monkeypatch)


def test_float64_deepseek_flash_with_the_kernels_on_trains_like_numpy(small_corpus, device):
    want = train(small_corpus, "numpy", *DS, "model.dtype=float64")
    got = train(small_corpus, "cupy", *DS, "model.dtype=float64")
    _same(got, want, 1e-10, 1e-12)
    assert {f"flash_{op}_f64" for op in ("fwd", "bwd_dq", "bwd_dkdv")} <= set(device.launches)


def test_bf16_deepseek_flash_with_the_kernels_on_trains_like_numpy(small_corpus, device):
    want = train_amp(small_corpus, "numpy", *DS, *BF16)
    got = train_amp(small_corpus, "cupy", *DS, *BF16)
    _same_amp(got, want)
    assert {f"flash_mma_{op}_bf16_hd64" for op in ("fwd", "bwd_dq", "bwd_dkdv")} <= set(device.launches)
