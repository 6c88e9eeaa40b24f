"""An independent float64 NumPy oracle of the llama kind's forward pass, written from Hugging Face's
LlamaForCausalLM equations (nothing from hpengine.nn or hpengine.models is imported), against the loss
the engine computes on the same parameters. Gradients are covered by test_model.py (finite differences
of the engine's loss); this pins what that loss is.

* x = wte[ids]; per layer x += o(attn(rmsnorm(x) * w_attn_norm)); x += down(silu(gate(h)) * up(h)) with
  h = rmsnorm(x) * w_mlp_norm; rmsnorm(x) = x / sqrt(mean(x^2) + eps); then the final norm, the head
  (lm_head.w, or wte^T when tied) and the cross-entropy summed over tokens and divided by `norm`.
* Attention, per query head h with key/value head h // (n_heads / n_kv_heads): q, k rotated with HF's
  apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, rotate_half(x) = cat(-x[hd/2:], x[:hd/2]),
  cos/sin of cat(freqs, freqs), freqs[t, i] = t / theta^(2i/hd); softmax(q k^T / sqrt(hd) + causal mask) v.
* Conventions taken from the layout: weights stored (in, out); the q/k/v output column of head h,
  element d, is h * hd + d.
"""
from __future__ import annotations

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.data.batch import Batch
from hpengine.run.build import build

B, T, V, C = 3, 8, 32, 16


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def oracle_loss(P, ids, targets, H, K, L, theta, eps, tied, norm):
    hd = C // H
    freqs = np.arange(T)[:, None] / theta ** (np.arange(0, hd, 2) / hd)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    x = P["wte"][ids]
    for i in range(L):
        p = f"h.{i}."
        h = rms(x, P[p + "attn_norm.w"], eps)
        q = (h @ P[p + "attn.q.w"]).reshape(B, T, H, hd)
        k = (h @ P[p + "attn.k.w"]).reshape(B, T, K, hd)
        v = (h @ P[p + "attn.v.w"]).reshape(B, T, K, hd)
        out = np.zeros((B, T, H, hd))
        for b in range(B):
            for j in range(H):
                qj = q[b, :, j] * cos + rotate_half(q[b, :, j]) * sin
                kj = k[b, :, j // (H // K)] * cos + rotate_half(k[b, :, j // (H // K)]) * sin
                s = qj @ kj.T / np.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
                e = np.exp(s - s.max(-1, keepdims=True))
                out[b, :, j] = (e / e.sum(-1, keepdims=True)) @ v[b, :, j // (H // K)]
        x = x + out.reshape(B, T, C) @ P[p + "attn.o.w"]
        h = rms(x, P[p + "mlp_norm.w"], eps)
        g, u = h @ P[p + "mlp.gate.w"], h @ P[p + "mlp.up.w"]
        x = x + (g / (1 + np.exp(-g)) * u) @ P[p + "mlp.down.w"]
    logits = rms(x, P["norm.w"], eps) @ (P["wte"].T if tied else P["lm_head.w"])
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).sum() / norm


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("oracle_llama") / "tokens.h5"
    with h5py.File(path, "w") as h5:
        h5["tokens"] = (np.arange(3000) * 7 % V).astype(np.uint8)
    return path


@pytest.mark.parametrize("H,K,tied", [(4, 2, False), (4, 1, True), (4, 4, False), (2, 2, True)])
def test_llama_loss_equals_the_oracle(corpus, H, K, tied):
    L, theta, eps = 2, 37.0, 1e-3          # a small theta turns every pair by a visible angle within T
    cfg = load_config(None, ["model.kind=llama", f"model.vocab_size={V}", f"model.seq_len={T}", f"model.d_model={C}",
                             f"model.n_layers={L}", f"model.n_heads={H}", f"model.n_kv_heads={K}",
                             "model.ffn_hidden=24", f"model.rope_theta={theta}", f"model.norm_eps={eps}",
                             f"model.tie_head={str(tied).lower()}", "model.dtype=float64", "model.init_std=0.3",
                             f"train.global_batch={B}", "runtime.backend=numpy", f"data.path={corpus}"])
    eng = build(cfg, MPI.COMM_SELF)
    # norm weights off their ones init, so a misplaced weight would show
    eng.sync.params.data += np.random.default_rng(3).normal(0.0, 0.2, eng.layout.total)
    P = eng.named_params()
    rng = np.random.default_rng(0)
    ids, targets = rng.integers(0, V, size=(B, T)), rng.integers(0, V, size=(B, T))
    norm = float(B * T)
    got = eng.forward_backward(eng.slots[0], Batch(ids, targets), norm, grad=False)
    want = oracle_loss(P, ids, targets, H, K, L, theta, eps, tied, norm)
    assert got == pytest.approx(want, rel=1e-12)
    # the oracle is sensitive to the conventions it pins: the other rotary pairing gives another loss
    assert abs(oracle_loss(P, ids, targets, H, K, L, theta * 3, eps, tied, norm) - want) > 1e-6
