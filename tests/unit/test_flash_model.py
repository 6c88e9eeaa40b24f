"""model.attention = "flash" in whole models, on one process in float64: the loss and every gradient equal
those of standard attention to 1e-10 (gpt, llama with grouped-query heads, deepseek's latent attention with values
narrower than its queries and keys), with blocks small enough
that T = 16 spans several tiles; the engine's counted caches equal model.cache_bytes and the planner's
prediction, and drop the T x T probabilities; the key is validated."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import ConfigError, load_config
from hpengine.data.batch import Batch
from hpengine.nn import flash, score_elements
from hpengine.planner.model import for_rank
from hpengine.run.build import build

B, T, V = 2, 16, 32
KIND_KEYS = {"gpt": ["model.n_heads=2"],
             "llama": ["model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=24", "model.rope_theta=100"],
             # multi-head latent attention: values narrower than the queries and keys, a query bottleneck
             "deepseek": ["model.n_heads=4", "model.ffn_hidden=24", "model.rope_theta=100", "model.mla.q_lora_rank=6",
                          "model.mla.kv_lora_rank=8", "model.mla.qk_nope_head_dim=4", "model.mla.qk_rope_head_dim=4",
                          "model.mla.v_head_dim=3"]}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("flash") / "tokens.h5"
    with h5py.File(path, "w") as h5:
        h5["tokens"] = (np.arange(3000) * 7 % V).astype(np.uint8)
    return path


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(flash, "BQ", 5)     # 16 positions: query tiles of 5, 5, 5, 1
    monkeypatch.setattr(flash, "BK", 3)


def make(corpus, kind, attention, *extra):
    cfg = load_config(None, [f"model.kind={kind}", f"model.vocab_size={V}", f"model.seq_len={T}", "model.d_model=16",
                             "model.n_layers=2", *KIND_KEYS[kind], f"model.attention={attention}",
                             "model.dtype=float64", "model.init_std=0.3", f"train.global_batch={B}",
                             "runtime.backend=numpy", f"data.path={corpus}", *extra])
    eng = build(cfg, MPI.COMM_SELF)
    eng.sync.params.data += np.random.default_rng(3).normal(0.0, 0.1, eng.layout.total)
    return cfg, eng


def loss_and_grads(eng):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    eng.sync.begin_step()
    loss = float(eng.forward_backward(eng.slots[0], Batch(x, y), float(B * T)))
    return loss, np.array(eng.sync.grads.data)


@pytest.mark.parametrize("kind", ["gpt", "llama", "deepseek"])
def test_flash_model_equals_standard(corpus, small_blocks, kind):
    _, std = make(corpus, kind, "standard")
    _, fl = make(corpus, kind, "flash")
    assert fl.slots[0].model.flash and not std.slots[0].model.flash
    np.testing.assert_array_equal(fl.sync.params.data, std.sync.params.data)
    l_std, g_std = loss_and_grads(std)
    l_fl, g_fl = loss_and_grads(fl)
    assert abs(l_fl - l_std) <= 1e-10 * abs(l_std)
    for name, r in std.layout.ranges.items():
        want, got = g_std[r.slice], g_fl[r.slice]
        assert np.abs(want).max() > 0, name
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10 * np.abs(g_std).max(), err_msg=name)


@pytest.mark.parametrize("kind", ["gpt", "llama", "deepseek"])
def test_flash_cache_bytes_follow_the_engine_and_the_planner(corpus, kind):
    got = {}
    for attention in ("standard", "flash"):
        cfg, eng = make(corpus, kind, attention)
        eng.train_step(0)
        measured = eng.memory()["activation_peak_bytes"]
        pred = for_rank(cfg, 1, eng.mesh.coords)["memory"]["activations"]
        assert pred == measured, (attention, pred, measured)
        m = eng.slots[0].model
        got[attention] = (measured, m.cache_bytes(B, 1, 8, False, B)["layer"])
    m = eng.slots[0].model
    H = m.H
    width = m.C if kind == "gpt" else 0     # GPT's standard path also keeps the scaled q (B T C)
    per_layer = 8 * (B * H * score_elements(T) + B * T * width - B * T * H)
    assert got["standard"][1] - got["flash"][1] == per_layer
    assert got["standard"][0] - got["flash"][0] == 2 * per_layer         # two layers' caches live at the peak


def test_attention_key_is_validated(corpus):
    with pytest.raises(ConfigError, match=r"model.attention = .fast.: must be one of .standard., .flash."):
        load_config(None, ["model.attention=fast", f"data.path={corpus}"])
    with pytest.raises(ConfigError, match="model.attention applies to"):
        load_config(None, ["model.kind=mlp", "model.attention=flash", f"data.path={corpus}"])


def test_deepseek_flash_trains_like_standard(corpus, small_blocks):
    """Five optimizer steps of the deepseek kind: flash and standard attention give the same losses, gradient
    norms and parameters (float64, 1e-10)."""
    out = {}
    for attention in ("standard", "flash"):
        _, eng = make(corpus, "deepseek", attention, "optim.lr=1e-2", "optim.warmup_steps=1")
        steps = [eng.train_step(s) for s in range(5)]
        out[attention] = ([m["loss"] for m in steps], [m["grad_norm"] for m in steps], np.array(eng.sync.params.data))
    (l_s, n_s, p_s), (l_f, n_f, p_f) = out["standard"], out["flash"]
    np.testing.assert_allclose(l_f, l_s, rtol=1e-10)
    np.testing.assert_allclose(n_f, n_s, rtol=1e-10)
    np.testing.assert_allclose(p_f, p_s, rtol=1e-10, atol=1e-12)
    assert np.abs(p_s - make(corpus, "deepseek", "standard")[1].sync.params.data).max() > 1e-3    # it trained
