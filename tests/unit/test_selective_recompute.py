"""Selective recompute at the layer level: a cache without its attention probabilities, rebuilt in
backward, gives the forward's probabilities and the same gradients bit for bit (standard and grouped-
query attention, and through the GPT and Llama layers); the mlp kind and flash attention drop nothing.
And the planner's recompute FLOPs against hand-computed values."""
from __future__ import annotations

import numpy as np
import pytest

from hpengine.config.load import load_config
from hpengine.models import LOCAL, build_model
from hpengine.nn import (attention_backward, attention_drop_scores, attention_forward, attention_restore_scores,
                         gqa_attention_backward, gqa_attention_forward, gqa_drop_scores, gqa_restore_scores)
from hpengine.planner.model import flops_per_microbatch
from hpengine.planner.stages import stages
from hpengine.layout.resolve import resolve

B, T = 2, 8


def _same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_attention_rebuilds_the_probabilities_bit_for_bit():
    rng = np.random.default_rng(0)
    H, hd = 2, 4
    qkv = rng.normal(size=(B, T, 3 * H * hd))
    y, cache = attention_forward(np, qkv, H)
    slim = attention_drop_scores(cache)
    assert slim[2] is None
    back = attention_restore_scores(np, slim)
    _same(back[2], cache[2])
    assert attention_restore_scores(np, cache) is cache          # a whole cache is left alone
    dy = rng.normal(size=y.shape)
    np.testing.assert_array_equal(attention_backward(np, dy, back), attention_backward(np, dy, cache))


@pytest.mark.parametrize("H,K", [(4, 2), (2, 2)])
def test_gqa_rebuilds_the_probabilities_bit_for_bit(H, K):
    rng = np.random.default_rng(1)
    hd = 4
    q, k, v = rng.normal(size=(B, H, T, hd)), rng.normal(size=(B, K, T, hd)), rng.normal(size=(B, K, T, hd))
    y, cache = gqa_attention_forward(np, q, k, v)
    slim = gqa_drop_scores(cache)
    assert slim[3] is None
    back = gqa_restore_scores(np, slim)
    _same(back[3], cache[3])
    dy = rng.normal(size=y.shape)
    _same(gqa_attention_backward(np, dy, back), gqa_attention_backward(np, dy, cache))


KINDS = {"gpt": [], "llama": ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=24"],
         "llama_qk_norm": ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=24",
                           "model.qk_norm=true"],
         "mlp": ["model.kind=mlp"], "gpt_flash": ["model.attention=flash"]}


@pytest.mark.parametrize("kind", list(KINDS))
def test_layer_without_scores_gives_the_same_gradients(kind):
    mcfg = load_config(None, ["model.d_model=16", "model.n_heads=2", f"model.seq_len={T}", "model.dtype=float64",
                              *KINDS[kind]]).model
    model, tp, rng = build_model(mcfg), LOCAL, np.random.default_rng(2)
    P = {sp.name: rng.normal(size=sp.global_shape) * 0.3 for sp in model.specs("h.0")}
    x, dy = rng.normal(size=(B, T, 16)), rng.normal(size=(B, T, 16))
    grads = []
    for keep in (True, False):
        G = {n: np.zeros_like(p) for n, p in P.items()}
        out, cache = model.layer_forward(np, P, 0, x.copy(), tp, keep_scores=keep)
        grads.append((out, model.layer_backward(np, dy.copy(), cache, P, G, 0, tp), G))
    (o1, d1, g1), (o2, d2, g2) = grads
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(d1, d2)
    for n in g1:
        np.testing.assert_array_equal(g1[n], g2[n], err_msg=n)
    a = model.cache_bytes(B, 1, 8, False, B)
    assert (a["scores"] == 0) == (kind in ("mlp", "gpt_flash"))    # nothing to drop without T x T probabilities


# ---- the planner's recompute FLOPs ----------------------------------------------------------------------
# a 4-layer GPT, d_model 16, 4 heads, T 8, 16 rows on one rank: tokens = 128 per micro-batch.
# Weights multiplied per layer: qkv 16x48 + proj 16x16 + fc 16x64 + proj 64x16 = 3072; head 16x256 = 4096.
# Attention forward per layer (4 T C per token): 4 * 128 * 8 * 16 = 65536; its score GEMM QK^T is half.
# Off: 6 * 128 * (4 * 3072 + 4096) + 3 * 65536 * 4 = 13 369 344.
# A fully recomputed layer adds its forward: 2 * 128 * 3072 + 65536 = 851 968 (the head never);
# a selective one its score GEMM only: 32 768.
TINY = ["model.kind=gpt", "model.d_model=16", "model.n_layers=4", "model.n_heads=4", "model.seq_len=8",
        "train.global_batch=16"]
RC = ["strategy.recompute.enable=true"]


def _flops(*extra):
    cfg = load_config(None, TINY + list(extra))
    lay = resolve(cfg, 1)
    return flops_per_microbatch(cfg.model, stages(cfg.model, 1, 1, 1)[0], lay)


@pytest.mark.parametrize("extra,want", [
    ([], 13_369_344),
    (RC + ["strategy.recompute.every=1"], 13_369_344 + 4 * 851_968),
    (RC + ["strategy.recompute.every=2"], 13_369_344 + 2 * 851_968),
    (RC + ["strategy.recompute.every=4"], 13_369_344 + 1 * 851_968),
    (RC + ["strategy.recompute.granularity=selective"], 13_369_344 + 4 * 32_768),
    (RC + ["strategy.recompute.granularity=selective", "strategy.recompute.every=2"], 13_369_344 + 2 * 32_768),
    (RC + ["strategy.recompute.granularity=selective", "model.attention=flash"], 13_369_344),
])
def test_recompute_flops_by_hand(extra, want):
    assert _flops(*extra) == want
