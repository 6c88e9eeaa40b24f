"""hpengine's llama kind against Hugging Face's LlamaForCausalLM: the export is a rename and a transpose.

A tiny llama with random float64 parameters runs hpengine's forward and hand-written backward (model
level, tp = 1; also with model.head_dim other than d_model / n_heads); the exported weights go into
transformers' LlamaForCausalLM (eager attention, float64), whose autograd gives the reference gradients. The loss is the cross-entropy summed over the given
targets / norm, computed here from HF's logits (not HF's shifted-label loss).

HF's Llama computes three things in float32 whatever the model dtype (RMSNorm statistics, the eager
softmax, the rotary angles), so stock HF agrees only to float32 precision; the exact comparison runs
HF's own code with modeling_llama's `torch.float32` / `torch.float` read as float64.

Needs the `hf` extra (torch, transformers >= 5); skipped without it.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from hf_oracle import Float64Torch  # noqa: E402
from hpengine.config.load import ffn_width, head_width, load_config  # noqa: E402
from hpengine.models import LOCAL, build_model  # noqa: E402

B, T, V, C, L, H, F, THETA, EPS = 2, 8, 37, 16, 2, 4, 24, 50.0, 1e-5


def hf_names(n_layers: int, tied: bool) -> dict:
    """hpengine name -> (Hugging Face name, transposed): the whole export."""
    m = {"wte": ("model.embed_tokens.weight", False), "norm.w": ("model.norm.weight", False)}
    if not tied:
        m["lm_head.w"] = ("lm_head.weight", True)
    for i in range(n_layers):
        p, q = f"h.{i}", f"model.layers.{i}"
        m[f"{p}.attn_norm.w"] = (f"{q}.input_layernorm.weight", False)
        m[f"{p}.mlp_norm.w"] = (f"{q}.post_attention_layernorm.weight", False)
        for a in "qkvo":
            m[f"{p}.attn.{a}.w"] = (f"{q}.self_attn.{a}_proj.weight", True)
        for a in ("gate", "up", "down"):
            m[f"{p}.mlp.{a}.w"] = (f"{q}.mlp.{a}_proj.weight", True)
    return m


def export(P: dict, names: dict) -> dict:
    return {hf: torch.from_numpy(np.ascontiguousarray(P[n].T if t else P[n])) for n, (hf, t) in names.items()}


def setup(n_kv: int, tied: bool, seed: int = 0, head_dim: int = 0):
    cfg = load_config(None, ["model.kind=llama", f"model.vocab_size={V}", f"model.seq_len={T}", f"model.head_dim={head_dim}",
                             f"model.d_model={C}", f"model.n_layers={L}", f"model.n_heads={H}",
                             f"model.n_kv_heads={n_kv}", f"model.ffn_hidden={F}", f"model.rope_theta={THETA}",
                             f"model.norm_eps={EPS}", f"model.tie_head={str(tied).lower()}",
                             "model.dtype=float64"])
    model, rng = build_model(cfg.model), np.random.default_rng(seed)
    P = {s.name: (1.0 + 0.2 * rng.standard_normal(s.global_shape) if len(s.global_shape) == 1
                  else 0.4 * rng.standard_normal(s.global_shape)) for s in model.all_specs()}
    ids, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    return cfg, model, P, ids, targets


def hf_config(mcfg) -> LlamaConfig:
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": mcfg.rope_theta}}
            if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters
            else {"rope_theta": mcfg.rope_theta})
    return LlamaConfig(vocab_size=mcfg.vocab_size, hidden_size=mcfg.d_model, intermediate_size=ffn_width(mcfg),
                       num_hidden_layers=mcfg.n_layers, num_attention_heads=mcfg.n_heads,
                       num_key_value_heads=mcfg.n_kv_heads or mcfg.n_heads, hidden_act="silu",
                       max_position_embeddings=mcfg.seq_len, rms_norm_eps=mcfg.norm_eps,
                       tie_word_embeddings=mcfg.tie_head, attention_bias=False, mlp_bias=False,
                       attention_dropout=0.0, attn_implementation="eager", head_dim=head_width(mcfg), **rope)


def hpengine_run(model, P, ids, targets, norm):
    """Model-level forward and backward, as the engine's chunk_forward / chunk_backward call them."""
    xp, tp = np, LOCAL
    G = {n: np.zeros_like(a) for n, a in P.items()}
    x, c_embed = model.embed_forward(xp, P, ids, tp)
    caches = []
    for i in range(model.n_layers):
        x, c = model.layer_forward(xp, P, i, x, tp)
        caches.append(c)
    loss, c_head = model.head_forward(xp, P, x, targets, norm, tp)
    d = model.head_backward(xp, c_head, G, tp, P)
    for i in reversed(range(model.n_layers)):
        d = model.layer_backward(xp, d, caches[i], P, G, i, tp)
    model.embed_backward(xp, d, c_embed, G, tp)
    return float(loss), G


def hf_run(mcfg, state, ids, targets, norm):
    """HF's loss and parameter gradients (by HF name) on an exported state dict."""
    hf = LlamaForCausalLM(hf_config(mcfg)).to(torch.float64)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if mcfg.tie_head else set())
    if mcfg.tie_head:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    hd = head_width(mcfg)
    inv = 1.0 / mcfg.rope_theta ** (np.arange(0, hd, 2) / hd)
    np.testing.assert_allclose(hf.model.rotary_emb.inv_freq.double().numpy(), inv, rtol=1e-6)
    hf.train()
    logits = hf(input_ids=torch.from_numpy(ids), use_cache=False).logits
    assert logits.dtype == torch.float64
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(targets).reshape(-1), reduction="sum") / norm
    loss.backward()
    return loss.item(), {n: p.grad.numpy() for n, p in hf.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("n_kv,head_dim", [(1, 0), (2, 0), (4, 0), (2, 6)],
                         ids=["kv1", "kv2", "kv4", "kv2_head_dim6"])
def test_hf_llama_same_loss_and_gradients(n_kv, head_dim, tied, monkeypatch):
    cfg, model, P, ids, targets = setup(n_kv, tied, head_dim=head_dim)
    assert P["h.0.attn.q.w"].shape == (C, H * (head_dim or C // H))
    norm = float(B * T) + 3.0          # any divisor: not HF's mean
    loss, G = hpengine_run(model, P, ids, targets, norm)
    names = hf_names(L, tied)
    state = export(P, names)

    stock_loss, _ = hf_run(cfg.model, state, ids, targets, norm)   # HF as shipped: float32 inside
    assert stock_loss == pytest.approx(loss, rel=1e-5)

    with monkeypatch.context() as m:
        m.setattr(modeling_llama, "torch", Float64Torch(torch))
        ref_loss, ref_grads = hf_run(cfg.model, state, ids, targets, norm)
    assert ref_loss == pytest.approx(loss, rel=1e-10, abs=0)
    assert set(ref_grads) == {hf for hf, _ in names.values()}
    for name, (hf, t) in names.items():
        ref = ref_grads[hf].T if t else ref_grads[hf]
        assert np.abs(ref).max() > 1e-6, f"{name}: reference gradient vanishes"
        np.testing.assert_allclose(G[name], ref, rtol=1e-8, atol=1e-12, err_msg=f"{name} <- {hf}")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_is_rename_and_transpose(tied):
    cfg, model, P, _, _ = setup(2, tied)
    names = hf_names(L, tied)
    specs = {s.name: s.global_shape for s in model.all_specs()}
    assert set(names) == set(specs)                                   # every hpengine tensor exported
    hf = LlamaForCausalLM(hf_config(cfg.model))
    hf_shapes = {n: tuple(p.shape) for n, p in hf.named_parameters()}  # tied: lm_head is embed_tokens
    targets = [hf_name for hf_name, _ in names.values()]
    assert len(set(targets)) == len(targets) and set(targets) == set(hf_shapes)   # a bijection
    for name, (hf_name, t) in names.items():
        assert hf_shapes[hf_name] == (specs[name][::-1] if t else specs[name]), name
        # 2-D tensors other than the embedding are transposed; vectors are copied
        assert t == (len(specs[name]) == 2 and name != "wte"), name
    state = export(P, names)
    for name, (hf_name, t) in names.items():
        assert np.array_equal(state[hf_name].numpy(), P[name].T if t else P[name])
