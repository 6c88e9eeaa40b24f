"""Multi-head latent attention on the CuPy stand-in (tests/unit/emulated_cupy.py): every CuPy branch it takes (the
fused rotary, norm and softmax kernels, strided cuBLAS products of value heads narrower than q/k's) gives the
NumPy path's forward, gradients and decoding steps, in float64 and float32.
"""
import emulated_cupy
import numpy as np
import pytest

from hpengine.nn.mla import mla_backward, mla_forward
from hpengine.nn.mla_decode import LatentCache, mla_decode
from hpengine.nn.rope import rope_tables
from test_mla import THETA, dims, weights


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("q_lora_rank,documents", [(4, False), (0, True)])
def test_mla_on_the_standin_equals_numpy(monkeypatch, dtype, tol, q_lora_rank, documents):
    cp = emulated_cupy.install(monkeypatch)
    r = np.random.default_rng(10)
    B, T, C, d = 2, 6, 6, dims(q_lora_rank, mscale=1.1)
    x = r.standard_normal((B, T, C)).astype(dtype)
    W = {n: a.astype(dtype) for n, a in weights(r, d, C).items()}
    dy = r.standard_normal((B, T, C)).astype(dtype)
    cos, sin = rope_tables(np, T, d.qk_rope_head_dim, THETA, dtype)
    seg = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]]) if documents else None
    if documents:
        pos = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 1]])
        cos, sin = cos[pos], sin[pos]
    out = []
    for xp in (np, cp):
        dev = (lambda a: a) if xp is np else (lambda a: cp.asarray(np.ascontiguousarray(a)))
        host = (lambda a: a) if xp is np else (lambda a: np.asarray(a.get()))
        Wd = {n: dev(a) for n, a in W.items()}
        Gd = {n: xp.zeros_like(a) for n, a in Wd.items()}
        args = (dev(cos), dev(sin))
        y, cache = mla_forward(xp, dev(x), Wd, d, *args, segments=None if seg is None else dev(seg))
        dx = mla_backward(xp, dev(dy), cache, Wd, Gd, d, *args)
        out.append([host(y), host(dx)] + [host(Gd[n]) for n in sorted(Gd)])
    assert cp.counts, "no kernel ran on the stand-in"
    for a, b in zip(*out):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol)


def test_mla_decode_on_the_standin(monkeypatch):
    cp = emulated_cupy.install(monkeypatch)
    r = np.random.default_rng(11)
    T, C, d = 5, 6, dims(4)
    x, W = r.standard_normal((1, T, C)), weights(r, d, C)
    cos, sin = rope_tables(np, T, d.qk_rope_head_dim, THETA, np.float64)
    want, _ = mla_forward(np, x, W, d, cos, sin)
    Wd = {n: cp.asarray(a) for n, a in W.items()}
    cache = LatentCache(cp, T, d, np.float64)
    got = [mla_decode(cp, cp.asarray(x[:, :2]), Wd, d, cp.asarray(cos[:2]), cp.asarray(sin[:2]), cache, 0)]
    got += [mla_decode(cp, cp.asarray(x[:, t:t + 1].copy()), Wd, d, cp.asarray(cos[t:t + 1]), cp.asarray(sin[t:t + 1]),
                       cache, t) for t in range(2, T)]
    np.testing.assert_allclose(np.concatenate([np.asarray(g.get()) for g in got], axis=1), want, rtol=1e-11,
                               atol=1e-12)
