"""model.qk_norm (llama kind, Qwen3): every head's q and k RMS-normalised over head_dim before the rotary
embedding. The per-head norm and the whole model's gradient (dense, flash, MoE) against central finite
differences in float64; the tensors it declares and their reduction groups (summed over tp with and without
sequence parallelism, counted once); the engine's counted caches equal the planner's prediction; the
planner's parameter count; a key of the llama kind only."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
from model_grads import assert_gradient_matches_differences, loss_and_grad
from mpi4py import MPI

from hpengine.config.load import ConfigError, ModelConfig, MoEConfig, load_config
from hpengine.layout.cache import cache_nbytes
from hpengine.layout.reduction import REPLICAS, norm_excluded, reductions, summed_over
from hpengine.layout.resolve import resolve
from hpengine.layout.stage import build_stage
from hpengine.models import build_model
from hpengine.nn import rmsnorm_backward, rmsnorm_cache_bytes, rmsnorm_forward
from hpengine.params.buffers import FlatBuffer, Layout
from hpengine.params.init import init_flat
from hpengine.planner.model import for_rank
from hpengine.planner.stages import stages
from hpengine.run.build import build

B, T, V, C, L, H, K = 2, 8, 40, 16, 3, 4, 2
HD = C // H
MOE = {"num_experts": 4, "top_k": 2, "expert_hidden": 12, "dense_layers": 1, "aux_loss": 0.05}


def model(qk=True, attention="standard", **moe):
    mc = ModelConfig(kind="llama", vocab_size=V, seq_len=T, d_model=C, n_layers=L, n_heads=H, n_kv_heads=K,
                     ffn_hidden=24, dtype="float64", qk_norm=qk, attention=attention, moe=MoEConfig(**moe))
    m = build_model(mc)
    lay = Layout(m.all_specs(), 0, 1)
    P = FlatBuffer(lay, np, np.float64)
    init_flat(P, 5)
    P.data[:] += np.random.default_rng(2).standard_normal(P.data.size) * 0.2     # norm weights away from 1
    return m, P, lay


def test_per_head_rmsnorm_against_finite_differences():
    """The norm over the last axis of (B, T, heads, hd) with one (hd,) weight shared by every head: its
    weight gradient sums over the heads too."""
    r = np.random.default_rng(0)
    x, w, ry = r.standard_normal((B, T, 3, 6)) + 0.1, r.standard_normal(6), r.standard_normal((B, T, 3, 6))
    y, cache = rmsnorm_forward(np, x, w, 1e-6)
    np.testing.assert_allclose(y, w * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6), rtol=1e-13)
    dw = np.zeros_like(w)
    dx = rmsnorm_backward(np, ry, cache, w, dw)
    f = lambda: float(np.sum(rmsnorm_forward(np, x, w, 1e-6)[0] * ry))
    for a, g in ((x, dx), (w, dw)):
        flat, num = a.reshape(-1), np.zeros(a.size)
        for j in range(a.size):
            old = flat[j]
            flat[j] = old + 1e-6
            up = f()
            flat[j] = old - 1e-6
            num[j] = (up - f()) / 2e-6
            flat[j] = old
        np.testing.assert_allclose(g.reshape(-1), num, rtol=1e-6, atol=1e-8)
    assert cache_nbytes(cache, set()) == rmsnorm_cache_bytes(B * T * 3, 6, 8)


@pytest.mark.parametrize("case", ["dense", "flash", "moe"])
def test_whole_model_gradient_against_finite_differences(case):
    m, P, lay = model(attention="flash" if case == "flash" else "standard", **(MOE if case == "moe" else {}))
    rng = np.random.default_rng(0)
    idx, y = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    names = ["h.0.attn.q_norm.w", "h.0.attn.k_norm.w", "h.2.attn.q_norm.w", "h.1.attn.k_norm.w", "h.1.attn.q.w",
             "h.2.attn.k.w", "h.0.attn_norm.w", "wte"]
    assert_gradient_matches_differences(m, P, lay, idx, y, names, rng)


def test_the_norms_change_the_model_and_off_is_as_before():
    """With the norms' weights the model differs from the plain llama; without qk_norm no tensor is added."""
    m, P, lay = model()
    plain, Pp, lay_p = model(qk=False)
    assert set(lay.names) - set(lay_p.names) == {f"h.{i}.attn.{a}_norm.w" for i in range(L) for a in "qk"}
    for n in lay_p.names:
        Pp[n] = P[n]
    idx, y = np.random.default_rng(1).integers(0, V, (2, B, T))
    assert loss_and_grad(m, P, lay, idx, y, False)[0] != loss_and_grad(plain, Pp, lay_p, idx, y, False)[0]


def test_specs_are_replicated_norms_summed_over_tp_with_and_without_sequence_parallel():
    m, _, _ = model()
    sp = {s.name: s for s in m.specs("h.1")}["h.1.attn.q_norm.w"]
    assert (sp.global_shape, sp.tp_dim, sp.decay, sp.init, sp.tp_partial) == ((HD,), None, False, "ones", True)
    cfg = load_config(None, ["model.kind=llama", f"model.d_model={C}", f"model.n_heads={H}", f"model.n_kv_heads={K}",
                             "model.ffn_hidden=24", "model.n_layers=2", f"model.seq_len={T}", "model.qk_norm=true",
                             "train.global_batch=4", "strategy.tensor_parallel.enable=true",
                             "strategy.tensor_parallel.degree=2"])
    for tp_rank in (0, 1):
        st = build_stage(cfg.model, resolve(cfg, 2), 0, tp_rank)
        assert st.layout.shapes["h.0.attn.k_norm.w"] == (HD,)          # every tp rank holds the whole weight
        for seq in (False, True):
            r = {x.tensor: x for x in reductions(st, tp_rank, seq)}
            for n in ("h.0.attn.q_norm.w", "h.1.attn.k_norm.w"):
                assert r[n].sum_over == REPLICAS + ("tp",) and r[n].counted == (tp_rank == 0)
            assert r["h.0.attn_norm.w"].sum_over == REPLICAS + (("tp",) if seq else ())
            if not seq:         # plain tp sums the q/k norms only
                assert summed_over(r.values(), "tp") == [f"h.{i}.attn.{a}_norm.w" for i in range(2) for a in "qk"]
            assert ("h.0.attn.q_norm.w" in norm_excluded(r.values())) == (tp_rank > 0)


def test_planner_counts_the_norm_weights():
    cfg = lambda qk: load_config(None, ["model.kind=llama", "model.d_model=32", "model.n_heads=4",
                                        "model.n_kv_heads=2", "model.ffn_hidden=48", "model.n_layers=3",
                                        f"model.qk_norm={str(qk).lower()}"]).model
    with_qk, plain = stages(cfg(True), 1, 1, 1)[0], stages(cfg(False), 1, 1, 1)[0]
    assert with_qk.psi - plain.psi == 3 * 2 * 8 and with_qk.matmul == plain.matmul
    # tp 2: the norms stay whole on each rank, everything else around them is as before
    assert stages(cfg(True), 2, 1, 1)[0].psi - stages(cfg(False), 2, 1, 1)[0].psi == 3 * 2 * 8
    assert sum(stages(cfg(True), 2, 1, 1)[0].partial) == 6 and not any(stages(cfg(False), 2, 1, 1)[0].partial)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("qk") / "tokens.h5"
    with h5py.File(path, "w") as h5:
        h5["tokens"] = (np.arange(3000) * 7 % V).astype(np.uint8)
    return path


@pytest.mark.parametrize("extra", [[], ["model.attention=flash"], ["strategy.recompute.enable=true",
                                                                   "strategy.recompute.granularity=selective"],
                                   [f"model.moe.{k}={v}" for k, v in MOE.items()],
                                   ["model.dtype=float32", "strategy.amp.enable=true"]],
                         ids=["standard", "flash", "selective", "moe", "amp"])
def test_counted_caches_equal_the_planner(corpus, extra):
    cfg = load_config(None, ["model.kind=llama", f"model.vocab_size={V}", f"model.seq_len={T}", f"model.d_model={C}",
                             f"model.n_layers={L}", f"model.n_heads={H}", f"model.n_kv_heads={K}", "model.ffn_hidden=24",
                             "model.qk_norm=true", "model.dtype=float64", f"train.global_batch={B}",
                             "runtime.backend=numpy", f"data.path={corpus}", *extra])
    eng = build(cfg, MPI.COMM_SELF)
    eng.train_step(0)
    assert for_rank(cfg, 1, eng.mesh.coords)["memory"]["activations"] == eng.memory()["activation_peak_bytes"]
    m = eng.slots[0].model
    plain = build_model(load_config(None, ["model.kind=llama", f"model.seq_len={T}", f"model.d_model={C}",
                                           f"model.n_layers={L}", f"model.n_heads={H}", f"model.n_kv_heads={K}",
                                           "model.ffn_hidden=24", *extra]).model)
    item = 2 if "strategy.amp.enable=true" in extra else 8 if cfg.model.dtype == "float64" else 4
    n = B * T
    want = rmsnorm_cache_bytes(n * H, HD, item) + rmsnorm_cache_bytes(n * K, HD, item)
    assert m.cache_bytes(B, 1, item, False, B)["layer"] - plain.cache_bytes(B, 1, item, False, B)["layer"] == want


def test_qk_norm_is_a_llama_key():
    with pytest.raises(ConfigError, match=r"model.qk_norm applies to model.kind = 'llama', not 'gpt'"):
        load_config(None, ["model.kind=gpt", "model.qk_norm=true"])
