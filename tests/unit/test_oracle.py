"""An independent float64 NumPy oracle of the tiny models, against the engine's one-process run.

The oracle below is written from the equations, not from hpengine's layers (nothing from hpengine.nn,
hpengine.models, hpengine.optim or hpengine.device.kernels is imported):

* GPT (pre-LN, GPT-2): x = wte[ids] + wpe[:T]; per layer x += attn(LN1(x)), x += mlp(LN2(x)), with
  causal softmax attention (scores scaled by 1/sqrt(head_dim)) and mlp(h) = gelu(h Wfc + bfc) Wp + bp,
  GELU being the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); then LN_f, the
  head (lm_head.w, or wte^T when tied) and the cross-entropy summed over tokens and divided by `norm`.
* MLP (kind = "mlp"): x = wte[ids]; per layer x += mlp(LN(x)); the same head and loss.
* LayerNorm: (x - mean) / sqrt(biased variance + 1e-5) * w + b over the last axis.
* The backward is derived by hand below; test_oracle_gradient_matches_finite_differences checks it
  against finite differences of the oracle's own loss, so the oracle does not rest on the derivation.
* AdamW (Loshchilov & Hutter, decoupled decay): gradients scaled by the global-norm clip coefficient
  c = min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_'s guard; max_norm 0 = off),
  m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, p -= lr wd p (decayed tensors only: the 2-D ones,
  i.e. embeddings and matrices; biases and LayerNorm gains are not decayed, the GPT-2 convention),
  p -= lr m/(1 - b1^t) / (sqrt(v/(1 - b2^t)) + eps).

Conventions the oracle takes from the parameter layout (not computation): tensor names and shapes,
weights stored (in, out) so a linear layer is x @ W + b, and the fused qkv output column of head h,
part j (0 = q, 1 = k, 2 = v), element d is h * 3 * hd + j * hd + d (head-major).

The engine's own initial parameters are the oracle's input (the oracle checks the computation, not
the initialisation).
"""
from __future__ import annotations

import math

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.data.batch import Batch
from hpengine.run.build import build

V, T, C, L, H, FFN = 64, 8, 16, 2, 2, 4
B = 4
LN_EPS = 1e-5
GELU_K, GELU_A = math.sqrt(2.0 / math.pi), 0.044715


# ------------------------------------------------------------------ the oracle: shapes

def oracle_shapes(kind: str, tied: bool) -> dict[str, tuple]:
    """Every tensor of the model, name -> shape, written from the architecture."""
    F = FFN * C
    s = {"wte": (V, C)}
    if kind == "gpt":
        s["wpe"] = (T, C)
    for i in range(L):
        p = f"h.{i}"
        if kind == "gpt":
            s.update({f"{p}.ln1.w": (C,), f"{p}.ln1.b": (C,),
                      f"{p}.attn.qkv.w": (C, 3 * C), f"{p}.attn.qkv.b": (3 * C,),
                      f"{p}.attn.proj.w": (C, C), f"{p}.attn.proj.b": (C,),
                      f"{p}.ln2.w": (C,), f"{p}.ln2.b": (C,)})
        else:
            s.update({f"{p}.ln.w": (C,), f"{p}.ln.b": (C,)})
        s.update({f"{p}.mlp.fc.w": (C, F), f"{p}.mlp.fc.b": (F,),
                  f"{p}.mlp.proj.w": (F, C), f"{p}.mlp.proj.b": (C,)})
    s.update({"ln_f.w": (C,), "ln_f.b": (C,)})
    if not tied:
        s["lm_head.w"] = (C, V)
    return s


# ------------------------------------------------------------------ the oracle: pieces

def ln_fwd(x, w, b):
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + LN_EPS)
    xhat = xc * rstd
    return xhat * w + b, (xhat, rstd)


def ln_bwd(dy, cache, w):
    """y = xhat w + b, xhat = (x - mean) rstd  ->  dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w."""
    xhat, rstd = cache
    dw = (dy * xhat).reshape(-1, dy.shape[-1]).sum(axis=0)
    db = dy.reshape(-1, dy.shape[-1]).sum(axis=0)
    g = dy * w
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, dw, db


def gelu_fwd(x):
    t = np.tanh(GELU_K * (x + GELU_A * x ** 3))
    return 0.5 * x * (1.0 + t), (x, t)


def gelu_bwd(dy, cache):
    # d/dx [0.5 x (1 + tanh u)] = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) K (1 + 3 A x^2)
    x, t = cache
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + 3.0 * GELU_A * x * x))


def attn_fwd(qkv):
    Bq, Tq, _ = qkv.shape
    hd = C // H
    a = qkv.reshape(Bq, Tq, H, 3, hd)
    q, k, v = (a[:, :, :, j, :].transpose(0, 2, 1, 3) for j in range(3))      # (B, H, T, hd)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
    future = np.triu(np.ones((Tq, Tq), dtype=bool), 1)                           # key j > query i
    s = np.where(future, -np.inf, s)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ v                                                                    # (B, H, T, hd)
    return o.transpose(0, 2, 1, 3).reshape(Bq, Tq, C), (q, k, v, p)


def attn_bwd(dy, cache):
    q, k, v, p = cache
    Bq, _, Tq, hd = q.shape
    do = dy.reshape(Bq, Tq, H, hd).transpose(0, 2, 1, 3)
    dv = p.transpose(0, 1, 3, 2) @ do
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))       # softmax Jacobian; masked p are 0
    dq = ds @ k / math.sqrt(hd)
    dk = ds.transpose(0, 1, 3, 2) @ q / math.sqrt(hd)
    dqkv = np.empty((Bq, Tq, H, 3, hd))
    for j, d in enumerate((dq, dk, dv)):
        dqkv[:, :, :, j, :] = d.transpose(0, 2, 1, 3)
    return dqkv.reshape(Bq, Tq, 3 * C)


def mlp_fwd(P, p, h):
    f = h @ P[f"{p}.fc.w"] + P[f"{p}.fc.b"]
    g, cg = gelu_fwd(f)
    return g @ P[f"{p}.proj.w"] + P[f"{p}.proj.b"], (h, g, cg)


def mlp_bwd(P, G, p, dm, cache):
    h, g, cg = cache
    G[f"{p}.proj.w"] += g.reshape(-1, g.shape[-1]).T @ dm.reshape(-1, C)
    G[f"{p}.proj.b"] += dm.reshape(-1, C).sum(axis=0)
    df = gelu_bwd(dm @ P[f"{p}.proj.w"].T, cg)
    G[f"{p}.fc.w"] += h.reshape(-1, C).T @ df.reshape(-1, df.shape[-1])
    G[f"{p}.fc.b"] += df.reshape(-1, df.shape[-1]).sum(axis=0)
    return df @ P[f"{p}.fc.w"].T


# ------------------------------------------------------------------ the oracle: model, loss, gradient

def oracle(P, x, y, norm, kind, tied, grad=True):
    """(loss, {name: gradient}) of the model with parameters P on ids x, targets y; loss = sum nll / norm."""
    Bx, Tx = x.shape
    h = P["wte"][x] + (P["wpe"][:Tx] if kind == "gpt" else 0.0)
    caches = []
    for i in range(L):
        p = f"h.{i}"
        if kind == "gpt":
            a_in, c1 = ln_fwd(h, P[f"{p}.ln1.w"], P[f"{p}.ln1.b"])
            qkv = a_in @ P[f"{p}.attn.qkv.w"] + P[f"{p}.attn.qkv.b"]
            att, ca = attn_fwd(qkv)
            h = h + att @ P[f"{p}.attn.proj.w"] + P[f"{p}.attn.proj.b"]
            m_in, c2 = ln_fwd(h, P[f"{p}.ln2.w"], P[f"{p}.ln2.b"])
            m, cm = mlp_fwd(P, f"{p}.mlp", m_in)
            h = h + m
            caches.append((c1, a_in, ca, att, c2, cm))
        else:
            m_in, c2 = ln_fwd(h, P[f"{p}.ln.w"], P[f"{p}.ln.b"])
            m, cm = mlp_fwd(P, f"{p}.mlp", m_in)
            h = h + m
            caches.append((c2, cm))
    hf, cf = ln_fwd(h, P["ln_f.w"], P["ln_f.b"])
    W = P["wte"].T if tied else P["lm_head.w"]                       # (C, V)
    z = hf @ W
    zmax = z.max(axis=-1, keepdims=True)
    lse = zmax[..., 0] + np.log(np.exp(z - zmax).sum(axis=-1))
    nll = lse - np.take_along_axis(z, y[..., None], axis=-1)[..., 0]
    loss = float(nll.sum() / norm)
    if not grad:
        return loss, None

    G = {n: np.zeros(s) for n, s in oracle_shapes(kind, tied).items()}
    dz = np.exp(z - lse[..., None])                                   # softmax
    dz[np.arange(Bx)[:, None], np.arange(Tx)[None, :], y] -= 1.0
    dz /= norm
    dW = hf.reshape(-1, C).T @ dz.reshape(-1, V)
    if tied:
        G["wte"] += dW.T
    else:
        G["lm_head.w"] += dW
    dh, G["ln_f.w"], G["ln_f.b"] = ln_bwd(dz @ W.T, cf, P["ln_f.w"])
    for i in reversed(range(L)):
        p = f"h.{i}"
        if kind == "gpt":
            c1, a_in, ca, att, c2, cm = caches[i]
            dm_in = mlp_bwd(P, G, f"{p}.mlp", dh, cm)
            d, G[f"{p}.ln2.w"], G[f"{p}.ln2.b"] = ln_bwd(dm_in, c2, P[f"{p}.ln2.w"])
            dh = dh + d
            G[f"{p}.attn.proj.w"] += att.reshape(-1, C).T @ dh.reshape(-1, C)
            G[f"{p}.attn.proj.b"] += dh.reshape(-1, C).sum(axis=0)
            dqkv = attn_bwd(dh @ P[f"{p}.attn.proj.w"].T, ca)
            G[f"{p}.attn.qkv.w"] += a_in.reshape(-1, C).T @ dqkv.reshape(-1, 3 * C)
            G[f"{p}.attn.qkv.b"] += dqkv.reshape(-1, 3 * C).sum(axis=0)
            d, G[f"{p}.ln1.w"], G[f"{p}.ln1.b"] = ln_bwd(dqkv @ P[f"{p}.attn.qkv.w"].T, c1, P[f"{p}.ln1.w"])
            dh = dh + d
        else:
            c2, cm = caches[i]
            d, G[f"{p}.ln.w"], G[f"{p}.ln.b"] = ln_bwd(mlp_bwd(P, G, f"{p}.mlp", dh, cm), c2, P[f"{p}.ln.w"])
            dh = dh + d
    if kind == "gpt":
        G["wpe"][:Tx] += dh.sum(axis=0)
    np.add.at(G["wte"], x, dh)
    return loss, G


def adamw_steps(P0, grad_fn, steps, lr, betas, eps, wd, max_norm):
    """`steps` AdamW updates from P0; grad_fn(t, P) -> (loss, grads). Returns (params, losses, norms)."""
    b1, b2 = betas
    P = {n: a.copy() for n, a in P0.items()}
    m = {n: np.zeros_like(a) for n, a in P.items()}
    v = {n: np.zeros_like(a) for n, a in P.items()}
    losses, norms = [], []
    for t in range(1, steps + 1):
        loss, G = grad_fn(t - 1, P)
        norm = math.sqrt(sum(float((g * g).sum()) for g in G.values()))
        c = 1.0 if max_norm == 0 or norm <= max_norm else max_norm / (norm + 1e-6)
        for n in P:
            g = c * G[n]
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            if P[n].ndim == 2:                   # decoupled weight decay on embeddings and matrices
                P[n] = P[n] - lr * wd * P[n]
            P[n] = P[n] - lr * (m[n] / (1 - b1 ** t)) / (np.sqrt(v[n] / (1 - b2 ** t)) + eps)
        losses.append(loss)
        norms.append(norm)
    return P, losses, norms


# ------------------------------------------------------------------ the engine side

@pytest.fixture(scope="module")
def corpus64(tmp_path_factory):
    """Random byte tokens below V (no vocab attribute: the token values themselves are checked)."""
    path = tmp_path_factory.mktemp("oracle") / "tokens.h5"
    with h5py.File(path, "w") as h5:
        h5["tokens"] = np.random.default_rng(42).integers(0, V, 4000).astype(np.uint8)
    return path


def make_engine(corpus, kind, tied, *extra):
    cfg = load_config(None, [
        f"model.kind='{kind}'", f"model.vocab_size={V}", f"model.seq_len={T}", f"model.d_model={C}",
        f"model.n_layers={L}", f"model.n_heads={H}", f"model.ffn_mult={FFN}",
        f"model.tie_head={str(tied).lower()}", "model.dtype='float64'", "runtime.backend='numpy'",
        f"train.global_batch={B}", "train.seed=1234", f"data.path={corpus}", *extra])
    return build(cfg, MPI.COMM_SELF)


def engine_tensors(eng, flat) -> dict[str, np.ndarray]:
    """A flat buffer of the one-process run cut into its tensors, by the layout's ranges and shapes."""
    lay = eng.layout
    return {n: np.array(flat[lay.ranges[n].slice]).reshape(lay.shapes[n]) for n in lay.ranges}


def check_layout(eng, kind, tied):
    want = oracle_shapes(kind, tied)
    assert set(eng.layout.ranges) == set(want)
    for n, s in want.items():
        assert tuple(eng.layout.shapes[n]) == s, n
    assert eng.layout.total == sum(math.prod(s) for s in want.values())


MODELS = [("gpt", False), ("gpt", True), ("mlp", False), ("mlp", True)]
IDS = [f"{k}-{'tied' if t else 'untied'}" for k, t in MODELS]


def random_batch(seed, rows=B):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, size=(rows, T)), rng.integers(0, V, size=(rows, T))


def perturbed(eng, seed):
    """The engine's initial parameters moved off their special values (LayerNorm ones, zero biases), so
    a transposed or mis-broadcast gain/bias cannot hide, and large enough for peaked softmaxes."""
    P0 = np.array(eng.sync.params.data, dtype=np.float64)
    return P0 + np.random.default_rng(seed).normal(0.0, 0.1, P0.size)


# ------------------------------------------------------------------ the oracle checks itself

FD_H = 1e-4


@pytest.mark.parametrize("kind,tied", MODELS, ids=IDS)
def test_oracle_gradient_matches_finite_differences(corpus64, kind, tied):
    eng = make_engine(corpus64, kind, tied)
    check_layout(eng, kind, tied)
    P = engine_tensors(eng, perturbed(eng, 3))
    x, y = random_batch(0)
    norm = 11.5 * T
    _, G = oracle(P, x, y, norm, kind, tied)
    rng = np.random.default_rng(1)
    scale = max(np.abs(g).max() for g in G.values())
    bad = []
    for n, a in P.items():
        for i in rng.choice(a.size, size=min(3, a.size), replace=False):
            flat = a.reshape(-1)
            old, vals = flat[i], []
            for s in (-2, -1, 1, 2):
                flat[i] = old + s * FD_H
                vals.append(oracle(P, x, y, norm, kind, tied, grad=False)[0])
            flat[i] = old
            num = (vals[0] - 8 * vals[1] + 8 * vals[2] - vals[3]) / (12 * FD_H)
            ana = G[n].reshape(-1)[i]
            if abs(ana - num) > 1e-6 * max(abs(ana), abs(num), 1e-4 * scale):
                bad.append(f"{n}[{i}]: analytic {ana:.10e} numeric {num:.10e}")
    assert not bad, "the oracle's own backward is wrong:\n" + "\n".join(bad)


# ------------------------------------------------------------------ engine vs oracle: one pass

@pytest.mark.parametrize("kind,tied", MODELS, ids=IDS)
def test_forward_backward_matches_the_oracle(corpus64, kind, tied):
    eng = make_engine(corpus64, kind, tied)
    flat = perturbed(eng, 5)
    eng.sync.params.data[...] = flat
    P = engine_tensors(eng, flat)
    x, y = random_batch(2)
    norm = 11.5 * T                           # not the pass's own token count: the division is by `norm`
    eng.sync.begin_step()
    got_loss = eng.forward_backward(eng.slots[0], Batch(x, y), norm)
    got = engine_tensors(eng, eng.sync.grads.data)
    want_loss, want = oracle(P, x, y, norm, kind, tied)
    assert got_loss == pytest.approx(want_loss, rel=1e-12, abs=0)
    scale = max(np.abs(g).max() for g in want.values())
    for n in want:
        # atol: entries that are exactly 0 in exact arithmetic (the key bias: softmax ignores a shift of a
        # query's scores) come out as round-off of the order of 1e-16 x the gradient scale
        np.testing.assert_allclose(got[n], want[n], rtol=1e-9, atol=1e-13 * scale, err_msg=n)


# ------------------------------------------------------------------ engine vs oracle: optimizer steps

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
STEPS = 2


@pytest.mark.parametrize("kind,tied,max_norm", [("gpt", False, 0.05), ("gpt", True, 0.0), ("mlp", False, 0.05),
                                                ("mlp", True, 0.0)],
                         ids=["gpt-untied-clipped", "gpt-tied-unclipped", "mlp-untied-clipped",
                              "mlp-tied-unclipped"])
def test_train_steps_match_the_oracle(corpus64, kind, tied, max_norm):
    eng = make_engine(corpus64, kind, tied, f"optim.lr={LR}", f"optim.betas=[{BETAS[0]}, {BETAS[1]}]",
                      f"optim.eps={EPS}", f"optim.weight_decay={WD}", "optim.warmup_steps=0",
                      "optim.schedule='constant'", f"optim.clip_grad_norm={max_norm}", f"train.steps={STEPS}")
    P0 = engine_tensors(eng, eng.sync.params.data)
    seen = []                                 # the rows each step trains on (sampling is not under test)
    plain = eng.forward_backward

    def spy(slot, batch, norm, *a, **k):
        seen.append((np.array(batch.tokens), np.array(batch.targets), norm))
        return plain(slot, batch, norm, *a, **k)
    eng.forward_backward = spy
    metrics = []
    for s in range(STEPS):
        metrics.append(eng.train_step(s))
        assert len(seen) == s + 1, "train_step did not make exactly one forward_backward pass"
    for x, y, norm in seen:
        assert x.shape == y.shape == (B, T) and norm == B * T
        assert np.array_equal(x[:, 1:], y[:, :-1])          # targets are the next tokens

    def grad_fn(t, P):
        x, y, _ = seen[t]
        return oracle(P, x, y, float(B * T), kind, tied)       # the mean over the global batch's tokens
    want, losses, norms = adamw_steps(P0, grad_fn, STEPS, LR, BETAS, EPS, WD, max_norm)
    if max_norm:
        assert min(norms) > 2 * max_norm, "the clipped case must actually clip"
    for s, m in enumerate(metrics):
        assert m["loss"] == pytest.approx(losses[s], rel=1e-11, abs=0), f"step {s} loss"
        assert m["grad_norm"] == pytest.approx(norms[s], rel=1e-10, abs=0), f"step {s} grad norm"
        assert m["lr"] == LR
    assert abs(losses[0] - math.log(V)) < 0.1           # near-uniform prediction at the 0.02 init
    got = eng.named_params()
    assert set(got) == set(want)
    # atol: a gradient element that is 0 in exact arithmetic (the key bias) is round-off of ~1e-18 in
    # either implementation; Adam's first update lr g / (|g| + eps) turns it into up to ~1e-12
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-9, atol=1e-11, err_msg=n)
    # the comparison can fail: one step less, no weight decay or no clipping each moves some tensor
    # by far more than the tolerance
    variants = [adamw_steps(P0, grad_fn, STEPS - 1, LR, BETAS, EPS, WD, max_norm)[0],
                adamw_steps(P0, grad_fn, STEPS, LR, BETAS, EPS, 0.0, max_norm)[0]]
    if max_norm:
        variants.append(adamw_steps(P0, grad_fn, STEPS, LR, BETAS, EPS, WD, 0.0)[0])
    for other in variants:
        assert any(not np.allclose(other[n], want[n], rtol=1e-6, atol=1e-9) for n in want)
