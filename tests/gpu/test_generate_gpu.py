"""`hpengine generate --device gpu`: CuPy decoding (fused kernels, cuBLAS, device caches) against the NumPy
path on the same checkpoint, every model kind, float64: the same logits to rounding and the same greedy tokens,
with and without the cache. Skips cleanly without CuPy and a device."""
from __future__ import annotations

import io

import numpy as np
import pytest

from hpengine.device import backend
from hpengine.cli.commands import main
from hpengine.apps.generate import generate

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")
KINDS = {"gpt": ["model.kind=gpt", "model.n_heads=2"],
         "llama": ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2"], "mlp": ["model.kind=mlp"]}


@pytest.mark.parametrize("kind", list(KINDS))
def test_gpu_generate_equals_cpu(kind, small_corpus, tmp_path):
    run = tmp_path / kind
    sets = ["model.dtype=float64", "model.seq_len=48", "model.d_model=16", "model.n_layers=2", "train.steps=2",
            "train.global_batch=4", "train.eval_every=0", "runtime.backend=numpy", *KINDS[kind],
            f"data.path={small_corpus}", f"train.out_dir={run}"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 0
    for cache in (True, False):
        kw = dict(greedy=True, cache=cache, out=io.StringIO(), note=lambda s: None)
        cpu = generate(run, "The ", 24, device="cpu", **kw)
        gpu = generate(run, "The ", 24, device="gpu", **kw)
        assert gpu["device"] == "gpu" and gpu["tokens"] == cpu["tokens"]
        np.testing.assert_allclose(np.stack(gpu["logits"]), np.stack(cpu["logits"]), rtol=0, atol=1e-9)
