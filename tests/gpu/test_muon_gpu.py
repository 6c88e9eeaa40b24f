"""Muon on CuPy: the Newton-Schulz iteration in float32 on cuBLAS (a stack of same-shaped matrices is one batched
GEMM per product) against the float64 NumPy iteration, and one-process Muon steps (same-shaped matrices grouped
into one iteration per shape) against the CPU Muon in float64 from the same state. Skips without a device.

Tolerance: 1e-4 of the largest reference entry. The iterate after 5 quintic steps is near-orthogonal, entries
O(1/sqrt(n)); each float32 GEMM carries a relative error of about sqrt(k) 6e-8 (k <= 1024 here), and the five
steps amplify it by at most the polynomial's slope (about 3.4 at small singular values). Float32 NumPy against
float64 lands at 3e-6 of the largest entry for these shapes; a wrong product errs by the entries themselves."""
from __future__ import annotations

import numpy as np
import pytest

from hpengine.config.load import load_config
from hpengine.device import backend
from hpengine.models import build_model
from hpengine.optim import make_optimizer, muon
from hpengine.optim.muon import newton_schulz
from hpengine.params.buffers import Layout, Range

pytestmark = pytest.mark.skipif(not backend.cupy_usable(), reason="needs CuPy and a usable CUDA device")
cp = backend.cupy_module() if backend.cupy_usable() else None
QUINTIC = (3.4445, -4.775, 2.0315)
TOL = 1e-4
CFG = ["model.kind=llama", "model.seq_len=8", "model.d_model=32", "model.n_layers=3", "model.n_heads=4",
       "model.n_kv_heads=2", "model.ffn_hidden=48", "train.global_batch=4", "model.dtype=float64",
       "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=24", "model.moe.dense_layers=1",
       "optim.name=muon", "optim.weight_decay=0.1", "optim.betas=[0.9, 0.95]", "optim.eps=1e-8"]


def close(dev, host, scale):
    got = cp.asnumpy(dev).astype(np.float64)
    assert got.shape == host.shape and np.isfinite(got).all()
    err = np.abs(got - host).max()
    assert err <= TOL * scale, (err, scale)


@pytest.mark.parametrize("shape", [(4, 256, 256), (3, 512, 128), (2, 128, 1024), (1, 1024, 1024)])
def test_float32_iteration_on_the_device_matches_float64(shape):
    g = np.random.default_rng(0).standard_normal(shape)
    want = newton_schulz(np, g, QUINTIC, 5)
    got = newton_schulz(cp, cp.asarray(g, dtype=cp.float32), QUINTIC, 5)
    assert isinstance(got, cp.ndarray) and got.dtype == np.float32
    close(got, want, np.abs(want).max())
    # near-orthogonal (singular values in about [0.68, 1.13]): entries of rms s / sqrt(max(m, n))
    rms = np.sqrt((want ** 2).mean()) * np.sqrt(max(shape[1:]))
    assert 0.6 < rms < 1.2, rms


def test_muon_steps_on_the_device_match_the_cpu(monkeypatch):
    cfg = load_config(None, CFG)
    lay = Layout(build_model(cfg.model).all_specs())
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(lay.total) * 0.02
    grads = [rng.standard_normal(lay.total) * 0.1 for _ in range(2)]
    host = make_optimizer(cfg.optim, np, lay, Range(0, lay.total), np.float64)
    calls = []
    real = muon.by_shape
    monkeypatch.setattr(muon, "by_shape", lambda xp, stacks, fn: real(
        xp, stacks, lambda s: calls.append((s.shape, s.dtype)) or fn(s)))
    dev = make_optimizer(cfg.optim, cp, lay, Range(0, lay.total), np.float32)      # amp's float32 master state
    p_host, p_dev = p0.copy(), cp.asarray(p0, dtype=cp.float32)
    for g in grads:
        host.step(p_host, g, 0.01)
        dev.step(p_dev, cp.asarray(g, dtype=cp.float32), 0.01)
    shapes = {m[3][1:] for m in dev.matrices}
    stacks = [m[3] for m in dev.matrices]
    assert any(s[0] > 1 for s in stacks) and len(shapes) < len(stacks)     # expert stacks; shared shapes
    assert len(calls) == 2 * len(shapes) and all(dt == np.float32 for _, dt in calls)   # one iteration a shape
    assert sorted(c[0][0] for c in calls[:len(shapes)]) == sorted(
        sum(s[0] for s in stacks if s[1:] == sh) for sh in shapes)
    # float32 storage of p (~0.02) adds 2^-24 of it per step to the iteration's 1e-4 of the step
    step = np.abs(p_host - p0).max()
    close(p_dev, p_host, step + 4 * 2.0 ** -24 * np.abs(p0).max() / TOL)
    close(dev.m, host.m, np.abs(host.m).max())
