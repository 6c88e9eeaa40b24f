"""MuonClip's QK-Clip: the largest causal logit per head against hand-computed cases, the clip factors of Kimi K2's
rule (grouped-query: the queries by gamma, the shared key untouched), the engine's step against the same step
without the clip (only the clipped heads' q and k columns differ, by exactly the factors, from the maxima of the
step's forward, which match an oracle written here), flash attention measuring what the standard core does, and
the config's refusals (and what it accepts)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hpengine.config.load import ConfigError, load_config
from hpengine.layout.resolve import resolve
from hpengine.nn.logit_max import causal_max_logits, fused_max_logits
from hpengine.optim.qk_clip import clip_factors
from hpengine.run.build import build

GPT = ["model.kind=gpt", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
       "train.global_batch=4", "runtime.backend=numpy", "model.dtype=float64", "train.log_every=1000",
       "optim.name=muon", "optim.warmup_steps=0", "optim.lr=1e-2"]
LLAMA = ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=24"]


# ---- the measurement ----------------------------------------------------------------------------

def test_the_largest_logit_is_the_causal_one_by_hand():
    # one row, two positions, head width 1: head 0's largest kept score is q1 k0 = 2 x 3 = 6; head 1's masked
    # q0 k1 = 5 x 10 = 50 never enters the softmax, so its largest is q1 k1 = 0.1 x 10 = 1
    q = np.array([[[[1.0], [2.0]], [[5.0], [0.1]]]])                # (B, H, T, hd)
    k = np.array([[[[3.0], [-1.0]], [[0.2], [10.0]]]])
    np.testing.assert_array_equal(causal_max_logits(np, q, k), [6.0, 1.0])


def test_grouped_heads_read_their_group_key_and_the_max_runs_over_rows():
    # 2 query heads over 1 key head (hd 2), 2 rows: head 1 peaks in row 1 at q1 . k0 = (1, 4) . (2, 0) = 2 ... and
    # q1 . k1 = (1, 4) . (0, 3) = 12
    k = np.array([[[[2.0, 0.0], [0.0, 3.0]]], [[[1.0, 1.0], [0.0, 0.0]]]])     # (2, 1, 2, 2)
    q = np.zeros((2, 2, 2, 2))
    q[0, 0] = [[1.0, 0.0], [0.0, 1.0]]        # row 0, head 0: 2, then max(0, 3) = 3
    q[1, 1] = [[0.0, 0.0], [1.0, 4.0]]        # row 1, head 1: 0, then max(5, 0) = 5
    q[0, 1] = [[0.0, 0.0], [1.0, 4.0]]        # row 0, head 1: 0, then max(2, 12) = 12
    np.testing.assert_array_equal(causal_max_logits(np, q, k), [3.0, 12.0])


def test_the_fused_layout_scales_q_as_the_attention_does():
    rng = np.random.default_rng(0)
    B, T, H, hd = 2, 5, 3, 4
    qkv = rng.standard_normal((B, T, H * 3 * hd))
    v = qkv.reshape(B, T, H, 3, hd)
    s = np.einsum("bthd,bshd->bhts", v[:, :, :, 0], v[:, :, :, 1]) / math.sqrt(hd)
    s[:, :, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = -np.inf
    np.testing.assert_allclose(fused_max_logits(np, qkv, H), s.max(axis=(0, 2, 3)), rtol=1e-15)


def test_the_clip_factors_follow_kimi_k2():
    tau = 100.0
    fq, fk = clip_factors(np.array([200.0, 50.0]), tau, 1)        # one key per query: sqrt(gamma) each
    np.testing.assert_array_equal(fq, [math.sqrt(0.5), 1.0])
    np.testing.assert_array_equal(fk, fq)
    fq, fk = clip_factors(np.array([200.0, 50.0, 400.0, 100.0]), tau, 2)     # groups of 2: the query by gamma
    np.testing.assert_array_equal(fq, [0.5, 1.0, 0.25, 1.0])                  # at tau exactly: not above it
    np.testing.assert_array_equal(fk, [1.0, 1.0])


# ---- the engine's step --------------------------------------------------------------------------

def _step(corpus, *extra):
    eng = build(load_config(None, [*GPT, f"data.path={corpus}", *extra]))
    eng.train_step(0)
    return eng, eng.named_params()


def _layer0_oracle(eng, params):
    """Layer 0's largest logit per head on step 0's batch from the initial weights, written from the equations."""
    x = params["wte"][np.asarray(eng.rows.read("train", 0, eng.slots[0].seed).tokens)] + params["wpe"][:8]
    h = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eng.cfg.model.norm_eps)
    h = h * params["h.0.ln1.w"] + params["h.0.ln1.b"]
    qkv = (h @ params["h.0.attn.qkv.w"] + params["h.0.attn.qkv.b"]).reshape(*h.shape[:2], 2, 3, 8)
    s = np.einsum("bthd,bshd->bhts", qkv[:, :, :, 0], qkv[:, :, :, 1]) / math.sqrt(8)
    return np.where(np.tril(np.ones((8, 8), bool)), s, -np.inf).max(axis=(0, 2, 3))


@pytest.mark.parametrize("where", ["every head", "some heads"])
def test_the_clip_scales_the_updated_qk_columns_of_the_heads_above_tau(small_corpus, where):
    init = build(load_config(None, [*GPT, f"data.path={small_corpus}"])).named_params()
    off, p_off = _step(small_corpus)
    seen = off.post.logits if hasattr(off.post, "logits") else None
    assert seen is None                                   # off: nothing collects, the context is the plain one
    probe, _ = _step(small_corpus, "optim.muon_qk_clip=1e6")
    table = probe.post.logits.table(np.asarray)           # the step's maxima (one process: already global)
    np.testing.assert_allclose(table[0], _layer0_oracle(probe, init), rtol=1e-13)
    tau = 1e-3 if where == "every head" else float(np.median(table))
    on, p_on = _step(small_corpus, f"optim.muon_qk_clip={tau}")
    clipped = 0
    for i in range(2):
        for name in (f"h.{i}.attn.qkv.w", f"h.{i}.attn.qkv.b"):
            want = p_off[name].copy()
            for h in range(2):
                f = math.sqrt(tau / table[i, h]) if table[i, h] > tau else 1.0
                clipped += f != 1.0
                for c in (slice(h * 24, h * 24 + 8), slice(h * 24 + 8, h * 24 + 16)):      # q, k; v untouched
                    want[..., c] *= f
            np.testing.assert_allclose(p_on[name], want, rtol=1e-15, atol=0, err_msg=name)
    assert clipped == (8 if where == "every head" else 4)       # 2 layers x 2 heads x (w, b)
    for name in p_off:                   # everything else is the unclipped step's, bit for bit
        if ".attn.qkv." not in name:
            np.testing.assert_array_equal(p_on[name], p_off[name], err_msg=name)


def test_a_large_tau_changes_nothing(small_corpus):
    _, p_off = _step(small_corpus)
    _, p_on = _step(small_corpus, "optim.muon_qk_clip=1e6")
    for name in p_off:
        np.testing.assert_array_equal(p_on[name], p_off[name], err_msg=name)


def test_grouped_queries_take_gamma_and_the_shared_key_stays(small_corpus):
    _, p_off = _step(small_corpus, *LLAMA)
    on, p_on = _step(small_corpus, *LLAMA, "optim.muon_qk_clip=1e-3")
    table = on.post.logits.table(np.asarray)
    for i in range(2):
        want = p_off[f"h.{i}.attn.q.w"].copy()
        for h in range(4):
            want[:, h * 4:(h + 1) * 4] *= 1e-3 / table[i, h]
        np.testing.assert_allclose(p_on[f"h.{i}.attn.q.w"], want, rtol=1e-15, atol=0)
        np.testing.assert_array_equal(p_on[f"h.{i}.attn.k.w"], p_off[f"h.{i}.attn.k.w"])


@pytest.mark.parametrize("kind", [[], LLAMA])
def test_flash_attention_measures_what_the_standard_core_does(small_corpus, kind):
    std, p_std = _step(small_corpus, *kind, "optim.muon_qk_clip=1e-3")
    fl, p_fl = _step(small_corpus, *kind, "optim.muon_qk_clip=1e-3", "model.attention=flash")
    np.testing.assert_allclose(fl.post.logits.table(np.asarray), std.post.logits.table(np.asarray), rtol=1e-13)
    for name in p_std:
        np.testing.assert_allclose(p_fl[name], p_std[name], rtol=1e-10, atol=1e-13, err_msg=name)


def test_amp_scales_the_masters_and_writes_the_compute_copy(small_corpus):
    eng, _ = _step(small_corpus, "model.dtype=float32", "strategy.amp.enable=true", "strategy.amp.dtype=bfloat16",
                   "optim.muon_qk_clip=1e-3")
    held = np.asarray(eng.sync.owned_params(), dtype=np.float32)
    bits = held.view(np.uint32) if held.dtype == np.float32 else None
    assert bits is None or not (bits & 0xFFFF).any()                 # bfloat16 values
    np.testing.assert_allclose(held, eng.master, rtol=2 ** -8)       # the scaled masters, rounded


# ---- the config --------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, needs", [(["optim.name=adamw"], "optim.name = 'muon'"),
                                          ([*LLAMA, "model.qk_norm=true"], "model.qk_norm = false"),
                                          (["train.models=2"], "train.models = 1")])
def test_the_clip_is_refused_where_it_cannot_hold(extra, needs):
    with pytest.raises(ConfigError, match=needs):
        load_config(None, [*GPT, *extra, "optim.muon_qk_clip=50"])


def test_context_parallel_and_packed_documents_are_accepted():
    cfg = load_config(None, [*GPT, "optim.muon_qk_clip=50", "data.document_mask=true",
                             "strategy.context_parallel.enable=true", "strategy.context_parallel.degree=2"])
    assert resolve(cfg, 2).cp == 2
