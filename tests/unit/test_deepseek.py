"""The deepseek kind: its whole-model gradient against float64 central differences (with and without the query
bottleneck, YaRN, a dense layer, grouped sigmoid routing and a shared expert), its forward against a naive numpy
oracle written from the equations, its per-token FLOPs against planner/sizes.py, the planner's activation bytes
against the engine's count, and the config's refusals."""
import math

import h5py
import numpy as np
import pytest
from model_grads import assert_gradient_matches_differences
from test_mtp import loss_and_grad as mtp_loss_and_grad  # the loss with MTP's targets (tests/unit/test_mtp.py)
from test_mtp import rows as mtp_rows

from mpi4py import MPI

from hpengine.config.load import ConfigError, load_config
from hpengine.models import build_model, capabilities
from hpengine.models.context import LOCAL
from hpengine.params.buffers import FlatBuffer, Layout
from hpengine.params.init import init_flat
from hpengine.planner.model import for_rank
from hpengine.planner.sizes import MLAShape
from hpengine.run.build import build

B, T, V, C, H = 2, 8, 40, 16, 4
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=8", "model.moe.shared_hidden=6",
       "model.moe.dense_layers=1", "model.moe.router='sigmoid'", "model.moe.n_groups=2", "model.moe.topk_groups=1",
       "model.moe.routed_scaling=2.5", "model.moe.aux_loss=0.05"]
MLA = ["model.mla.kv_lora_rank=6", "model.mla.qk_nope_head_dim=4", "model.mla.qk_rope_head_dim=4",
       "model.mla.v_head_dim=3"]
YARN = ["model.rope_scaling.type='yarn'", "model.rope_scaling.factor=4.0",
        "model.rope_scaling.original_max_position_embeddings=4", "model.rope_scaling.mscale=1.0",
        "model.rope_scaling.mscale_all_dim=0.7"]


def config(*extra):
    return load_config(None, ["model.kind='deepseek'", f"model.vocab_size={V}", f"model.seq_len={T}",
                              f"model.d_model={C}", "model.n_layers=2", f"model.n_heads={H}", "model.ffn_hidden=12",
                              "model.rope_theta=100", "model.dtype='float64'", *MLA, *MOE, *extra])


def model(*extra):
    m = build_model(config(*extra).model)
    lay = Layout(m.all_specs(), 0, 1)
    P = FlatBuffer(lay, np, np.float64)
    init_flat(P, 5)
    P.data[:] += np.random.default_rng(2).standard_normal(P.data.size) * 0.2   # norms and routers off their init
    return m, P, lay


@pytest.mark.parametrize("extra", [(), ("model.mla.q_lora_rank=5",), ("model.mla.q_lora_rank=5", *YARN)],
                         ids=["plain-q", "q-lora", "q-lora-yarn"])
def test_whole_model_gradient_against_finite_differences(extra):
    m, P, lay = model(*extra)
    names = list(lay.ranges)
    q = ["h.0.attn.q_a.w", "h.0.attn.q_a_norm.w", "h.0.attn.q_b.w"] if extra else ["h.0.attn.q.w"]
    assert set(q + ["h.1.attn.kv_a.w", "h.1.attn.kv_b.w", "h.1.attn.kv_a_norm.w", "h.0.mlp.gate.w",
                    "h.1.moe.shared.up.w", "h.1.moe.experts.down.w"]) <= set(names)
    assert lay.shapes["h.1.attn.kv_b.w"] == (6, H * (4 + 3)) and lay.shapes["h.1.attn.o.w"] == (H * 3, C)
    rng = np.random.default_rng(0)
    idx, y = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    assert_gradient_matches_differences(m, P, lay, idx, y, names, rng, picks=3)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope_pairs(x, pos, theta):
    # x (..., T, dr) with DeepSeek's adjacent pairs (2i, 2i+1) -> rotated, written [evens', odds']
    dr = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, dr, 2) / dr)[None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)


def oracle_layer0(P, x, eps=1e-5):
    """Layer 0 (plain q, dense SwiGLU) from the equations, head by head and position by position."""
    dn, dr, dv, r = 4, 4, 3, 6
    h = _rms(x, P["h.0.attn_norm.w"], eps)
    q = (h @ P["h.0.attn.q.w"]).reshape(B, T, H, dn + dr)
    ckv = h @ P["h.0.attn.kv_a.w"]
    lat = _rms(ckv[..., :r], P["h.0.attn.kv_a_norm.w"], 1e-6)
    kv = (lat @ P["h.0.attn.kv_b.w"]).reshape(B, T, H, dn + dv)
    kr = _rope_pairs(ckv[..., r:], np.arange(T, dtype=float), 100.0)            # (B, T, dr), shared by the heads
    out = np.zeros((B, T, H, dv))
    for b in range(B):
        for hh in range(H):
            qr = _rope_pairs(q[b, :, hh, dn:], np.arange(T, dtype=float), 100.0)
            for t in range(T):
                s = np.array([(q[b, t, hh, :dn] @ kv[b, j, hh, :dn] + qr[t] @ kr[b, j]) / math.sqrt(dn + dr)
                              for j in range(t + 1)])
                p = np.exp(s - s.max())
                out[b, t, hh] = (p / p.sum()) @ kv[b, :t + 1, hh, dn:]
    o = x + out.reshape(B, T, H * dv) @ P["h.0.attn.o.w"]
    h2 = _rms(o, P["h.0.mlp_norm.w"], eps)
    g, u = h2 @ P["h.0.mlp.gate.w"], h2 @ P["h.0.mlp.up.w"]
    return o + (g / (1 + np.exp(-g)) * u) @ P["h.0.mlp.down.w"]


def test_dense_layer_forward_equals_the_equations():
    m, P, _ = model()
    x = np.random.default_rng(3).standard_normal((B, T, C))
    y, _ = m.layer_forward(np, P, 0, x, LOCAL)
    np.testing.assert_allclose(y, oracle_layer0(P, x), rtol=1e-12, atol=1e-12)


def test_loss_and_latent_cache_decoding_agree_with_the_full_forward():
    m, P, lay = model("model.mla.q_lora_rank=5", *YARN)
    ids = np.random.default_rng(4).integers(0, V, (1, T))
    x, _ = m.embed_forward(np, P, ids, LOCAL)
    for i in range(m.n_layers):
        x, _ = m.layer_forward(np, P, i, x, LOCAL)
    full = m.head_logits(np, P, x)[0]
    cache = m.decode_cache(np, np.float64)
    assert cache[0].latent.shape == (T, 6) and cache[0].rope_key.shape == (T, 4)
    rows, start = [], 0
    for n in (3, 1, 1, 2, 1):          # a prompt, then tokens one or two at a time
        x = m.decode_embed(np, P, ids[:, start:start + n], start)
        for i in range(m.n_layers):
            x = m.decode_layer(np, P, i, x, cache[i], start)
        rows.append(m.head_logits(np, P, x)[0])
        start += n
    np.testing.assert_allclose(np.concatenate(rows), full, rtol=0, atol=1e-10)


def test_flops_per_token_equal_the_planner_formula():
    """6 x the parameters a token activates (embedding lookup counted, as run.trace.model_flops does) + 3 x every
    layer's attention forward = planner/sizes.MLAShape.flops_per_token plus the embedding's 6 V C."""
    mc = config("model.mla.q_lora_rank=5").model
    m = build_model(mc)
    e = mc.moe
    active = sum(math.prod(s.global_shape) * (e.top_k / e.num_experts if ".moe.experts." in s.name else 1.0)
                 for s in m.all_specs())
    engine = 6 * active + 3 * mc.n_layers * m.attention_flops(1, 1)
    shape = MLAShape(vocab=V, d_model=C, n_layers=2, dense_layers=1, n_heads=H, q_lora_rank=5, kv_lora_rank=6,
                     qk_nope=4, qk_rope=4, v_head=3, ffn_hidden=12, expert_hidden=8, experts=4, shared=1, top_k=2,
                     n_groups=2, topk_groups=1)
    # the shared expert is one of width shared_hidden = 6, MLAShape's `shared` experts are expert_hidden wide
    shared_fix = 6 * 3 * C * (6 - 8) * (mc.n_layers - e.dense_layers)
    assert engine == pytest.approx(shape.flops_per_token(T) + 6 * V * C + shared_fix, rel=1e-15)
    assert m.attention_flops(10, 2) == 10 * 2 * T * H * (4 + 4 + 3) // 2
    caps = capabilities(mc)
    assert (caps.qk_width, caps.v_width, caps.kv_heads, caps.experts) == (8, 3, H, 4)


def test_yarn_scales_the_softmax_and_the_tables():
    m, _, _ = model(*YARN)
    ms = 0.1 * 0.7 * math.log(4.0) + 1
    assert m.mla.scale == pytest.approx(ms * ms / math.sqrt(8), rel=1e-15)
    cos, _ = m.mla_tables(np, np.float64)
    assert cos[0, 0] == pytest.approx((0.1 * math.log(4.0) + 1) / ms, rel=1e-15)


@pytest.mark.parametrize("keys,msg", [
    (["model.kind='llama'", "model.mla.kv_lora_rank=8"], "model.mla applies to model.kind = 'deepseek'"),
    (["model.kind='llama'", "model.rope_scaling.type='yarn'"], "model.rope_scaling applies to model.kind = 'deepseek'"),
    (["model.kind='deepseek'", "model.n_kv_heads=2"], "model.n_kv_heads applies to model.kind = 'llama'"),
    (["model.kind='deepseek'", "model.qk_norm=true"], "model.qk_norm applies to model.kind = 'llama'"),
    (["model.kind='deepseek'", "model.mla.qk_rope_head_dim=5"], "model.mla.qk_rope_head_dim = 5 is odd"),
    (["model.kind='deepseek'", "model.rope_scaling.factor=8.0"], "model.rope_scaling.type = 'none'"),
    (["model.kind='deepseek'", "model.rope_scaling.type='ntk'"], "model.rope_scaling.type = \"ntk\": must be one of"),
    (["model.kind='deepseek'", "optim.name='muon'", "optim.muon_qk_clip=100.0"], "multi-head latent attention"),
])
def test_config_refusals_are_one_line(keys, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, keys)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_tp_must_divide_the_heads():
    m = build_model(config().model)
    assert m.tp_divides(2) == "" and "model.n_heads = 4" in m.tp_divides(3)


@pytest.mark.parametrize("extra", [["model.mla.q_lora_rank=5"], MOE,
                                   ["strategy.recompute.enable=true", "strategy.recompute.granularity=selective"]],
                         ids=["dense-q-lora", "moe", "selective"])
def test_planner_predicts_the_counted_activations(tmp_path, extra):
    path = tmp_path / "tokens.h5"
    with h5py.File(path, "w") as h5:
        h5["tokens"] = (np.arange(3000) * 7 % V).astype(np.uint8)
    cfg = load_config(None, ["model.kind='deepseek'", f"model.vocab_size={V}", f"model.seq_len={T}",
                             f"model.d_model={C}", "model.n_layers=2", f"model.n_heads={H}", "model.ffn_hidden=12",
                             "model.dtype='float64'", "train.global_batch=2", "runtime.backend='numpy'",
                             f"data.path={path}", *MLA, *extra])
    eng = build(cfg, MPI.COMM_SELF)
    eng.train_step(0)
    got, want = eng.memory(), for_rank(cfg, 1, eng.mesh.coords)["memory"]
    assert (got["activation_peak_bytes"], got["param_bytes"]) == (want["activations"], want["params"])


def test_mtp_module_gradient_against_finite_differences():
    """A multi-token prediction module (DeepSeek-V3's) built from the kind's own block: MLA and a routed MLP."""
    m, P, lay = model("model.mla.q_lora_rank=5", "model.mtp.depth=1", "model.mtp.loss_weight=0.7")
    assert "mtp.0.attn.kv_b.w" in lay.ranges and "mtp.0.moe.router.w" in lay.ranges
    batch = mtp_rows(1)[0]
    rng = np.random.default_rng(1)
    _, G = mtp_loss_and_grad(m, P, lay, batch, 1)
    names = [n for n in lay.ranges if n.startswith("mtp.")] + ["wte", "h.0.attn.q_b.w", "lm_head.w"]
    eps = 1e-6
    for name in names:
        flat = P[name].reshape(-1)
        assert np.abs(G[name]).max() > 0, name
        for j in rng.choice(flat.size, size=min(flat.size, 3), replace=False):
            old = flat[j]
            flat[j] = old + eps
            lp, _ = mtp_loss_and_grad(m, P, lay, batch, 1, grad=False)
            flat[j] = old - eps
            lm, _ = mtp_loss_and_grad(m, P, lay, batch, 1, grad=False)
            flat[j] = old
            num, ana = (lp - lm) / (2 * eps), G[name].reshape(-1)[j]
            assert abs(num - ana) <= 1e-6 * max(1.0, abs(num)) + 1e-9, (name, j, num, ana)
