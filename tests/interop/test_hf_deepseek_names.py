"""models/hf_deepseek.py against transformers' DeepseekV3ForCausalLM, saved with save_pretrained (q compression on and
off, YaRN on and off, one MTP layer in the config): config.json gives the [model] keys written out here by hand and
hf_config gives back an equal DeepseekV3Config; the name map covers every saved tensor exactly once (the MTP
layer transformers does not build aside) at hpengine's shapes, transposed; and the model assembled from the mapped
weights with hpengine's layers (MLA, the MoE block, RMSNorm) gives transformers' logits (float64, 1e-10).

Needs the `hf` extra (torch, transformers >= 5 with DeepseekV3); skipped without them.
"""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, modeling_rope_utils  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402

from hf_oracle import exact, logits_of  # noqa: E402
from hpengine.config.load import load_config  # noqa: E402
from hpengine.models import LOCAL, build_model, hf_deepseek  # noqa: E402
from hpengine.nn import rmsnorm_forward  # noqa: E402
from hpengine.nn.mla import MLADims, mla_forward  # noqa: E402
from hpengine.nn.rope import YaRN, rope_tables  # noqa: E402

V, C, F, FE, L, DENSE, H, E, K, G, TG, T = 40, 16, 24, 6, 3, 1, 2, 8, 2, 4, 2, 7
YARN = {"factor": 6.0, "original_max_position_embeddings": 4, "beta_fast": 4.0, "beta_slow": 1.0, "mscale": 0.8,
        "mscale_all_dim": 1.3}
CASES = [(5, True), (0, True), (5, False)]                     # (q_lora_rank, YaRN)


def hf_config(q_lora_rank, yarn) -> DeepseekV3Config:
    rope = {"rope_type": "yarn", "rope_theta": 300.0, **YARN} if yarn else {"rope_type": "default", "rope_theta": 300.0}
    return DeepseekV3Config(vocab_size=V, hidden_size=C, intermediate_size=F, moe_intermediate_size=FE,
                            num_hidden_layers=L, first_k_dense_replace=DENSE, num_attention_heads=H,
                            num_key_value_heads=H, n_routed_experts=E, n_shared_experts=2, num_experts_per_tok=K,
                            n_group=G, topk_group=TG, routed_scaling_factor=2.5, norm_topk_prob=True,
                            q_lora_rank=q_lora_rank or None, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2,
                            v_head_dim=3, rms_norm_eps=1e-6, max_position_embeddings=32, rope_parameters=rope,
                            num_nextn_predict_layers=1, initializer_range=0.05, attn_implementation="eager",
                            experts_implementation="eager")


def expected_keys(q_lora_rank, yarn) -> dict:
    """The [model] keys of hf_config(...), by hand from the field correspondence."""
    keys = {"model.kind": "deepseek", "model.d_model": C, "model.n_layers": L, "model.n_heads": H, "model.ffn_hidden": F,
            "model.norm_eps": 1e-6, "model.vocab_size": V, "model.init_std": 0.05, "model.tie_head": False,
            "model.rope_theta": 300.0, "model.mla.q_lora_rank": q_lora_rank, "model.mla.kv_lora_rank": 6,
            "model.mla.qk_nope_head_dim": 4, "model.mla.qk_rope_head_dim": 2, "model.mla.v_head_dim": 3,
            "model.mtp.depth": 1, "model.moe.num_experts": E, "model.moe.top_k": K, "model.moe.expert_hidden": FE,
            "model.moe.shared_hidden": 2 * FE, "model.moe.dense_layers": DENSE, "model.moe.router": "sigmoid",
            "model.moe.norm_topk": True, "model.moe.n_groups": G, "model.moe.topk_groups": TG,
            "model.moe.routed_scaling": 2.5}
    if yarn:
        keys["model.rope_scaling.type"] = "yarn"
        keys.update({f"model.rope_scaling.{k}": v for k, v in YARN.items()})
    return keys


def hpengine_shapes(q_lora_rank, dense=DENSE) -> dict:
    """hpengine name -> shape, from the layers' own declarations (MLADims, the MoE block's (E, in, out) stacks)."""
    d = MLADims(H, q_lora_rank, 6, 4, 2, 3)
    out = {"wte": (V, C), "norm.w": (C,), "lm_head.w": (C, V)}
    for i in range(L):
        p = f"h.{i}"
        out.update({f"{p}.attn.{n}": s for n, s in d.weight_shapes(C).items()})
        out.update({f"{p}.attn_norm.w": (C,), f"{p}.mlp_norm.w": (C,)})
        if i < dense:
            out.update({f"{p}.mlp.gate.w": (C, F), f"{p}.mlp.up.w": (C, F), f"{p}.mlp.down.w": (F, C)})
        else:
            m = f"{p}.moe"
            out.update({f"{m}.router.w": (C, E), f"{m}.experts.gate.w": (E, C, FE), f"{m}.experts.up.w": (E, C, FE),
                        f"{m}.experts.down.w": (E, FE, C), f"{m}.shared.gate.w": (C, 2 * FE),
                        f"{m}.shared.up.w": (C, 2 * FE), f"{m}.shared.down.w": (2 * FE, C)})
    return out


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"q_lora{c[0]}-{'yarn' if c[1] else 'rope'}")
def saved(request, tmp_path_factory):
    """(case, config.json, the saved tensors as float64 numpy, the folder) of a perturbed float64 DeepseekV3ForCausalLM."""
    folder = tmp_path_factory.mktemp("deepseek")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(hf_config(*request.param)).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for layer in model.model.layers[DENSE:]:       # a buffer, zero at init: a bias that moves the selection
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(E, dtype=torch.float64))
    model.save_pretrained(folder)
    hc = json.loads((folder / "config.json").read_text())
    tensors = {k: v.numpy() for k, v in safetensors_torch.load_file(str(folder / "model.safetensors")).items()}
    return request.param, hc, tensors, folder


def test_config_round_trip(saved):
    case, hc, _, _ = saved
    keys = hf_deepseek.keys_from_hf(hc, "hf:x")
    assert keys == expected_keys(*case)
    back = hf_deepseek.hf_config({**keys, "model.seq_len": 32}, "float64", None)
    assert hf_deepseek.keys_from_hf(back, "hf:x") == keys
    ours, theirs = DeepseekV3Config(**{k: v for k, v in back.items() if k != "architectures"}), hf_config(*case)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                  "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
                  "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps", "vocab_size",
                  "tie_word_embeddings", "num_nextn_predict_layers", "rope_interleave", "hidden_act", "qk_head_dim"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert {k: v for k, v in ours.rope_parameters.items() if v is not None} == theirs.rope_parameters


def test_dense_config_round_trip():
    keys = {**expected_keys(0, False), "model.moe.num_experts": 0, "model.seq_len": 32}
    for k in [k for k in keys if k.startswith("model.moe.") and k != "model.moe.num_experts"]:
        del keys[k]
    back = hf_deepseek.hf_config(keys, "float32", None)
    assert back["first_k_dense_replace"] == L
    assert hf_deepseek.keys_from_hf(back, "hf:x") == {k: v for k, v in keys.items() if k != "model.seq_len"}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in back.items() if k != "architectures"}))
    assert not any(".experts." in n for n, _ in model.named_parameters())
    P = {n: np.zeros(s) for n, s in hpengine_shapes(0, dense=L).items()}
    got = hf_deepseek.to_hf(P, {**keys, "model.mtp.depth": 0})
    assert {k: v.shape for k, v in got.items()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_every_tensor_mapped_once(saved):
    case, hc, tensors, _ = saved
    keys = hf_deepseek.keys_from_hf(hc, "hf:x")
    plain, experts = hf_deepseek.names(keys), hf_deepseek.expert_names(keys)
    bias = hf_deepseek.bias_names(keys)
    used = Counter([h for h, _ in plain.values()] + [h for hs in experts.values() for h in hs]
                   + [h for row, h in bias.items() if row != "mtp.0"])
    mtp = hf_deepseek.mtp_names(keys)
    mtp_hf = [h for h, _ in mtp[0].values()] + [h for hs in mtp[1].values() for h in hs] + \
        list(hf_deepseek.mtp_copies(keys)) + [bias["mtp.0"]]
    assert max(used.values()) == 1 and set(used) == set(tensors) - {n for n in mtp_hf}
    assert not any(n.startswith(f"model.layers.{L}.") for n in tensors)      # transformers builds no MTP layer
    assert len(set(mtp_hf)) == len(mtp_hf) and all(n.startswith(f"model.layers.{L}.") for n in mtp_hf)
    # the MTP layer holds a routed block under the names a routed layer has, plus its own five
    routed = {h.replace(f"layers.{L - 1}.", f"layers.{L}.") for h in used if h.startswith(f"model.layers.{L - 1}.")}
    own = {f"model.layers.{L}.{n}" for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                                              "embed_tokens.weight", "shared_head.head.weight")}
    assert set(mtp_hf) == routed | own
    P = {n: fn(tuple(tensors[h] for h in hf) if isinstance(hf, tuple) else tensors[hf])
         for n, (hf, fn) in hf_deepseek.from_hf_map({**keys, "model.mtp.depth": 0}).items()}
    assert {n: a.shape for n, a in P.items()} == hpengine_shapes(case[0])
    bias = {row: tensors[h] for row, h in hf_deepseek.bias_names(keys).items() if row != "mtp.0"}
    back = hf_deepseek.to_hf(P, {**keys, "model.mtp.depth": 0}, bias)
    assert sorted(back) == sorted(tensors) and all(np.array_equal(back[k], tensors[k]) for k in tensors)


def hpengine_logits(P, bias, keys, ids):
    """Logits of the model assembled from hpengine's layers: MLA, the llama kind's MoE block, RMSNorm, SwiGLU."""
    yarn = YaRN(**{k: keys[f"model.rope_scaling.{k}"] for k in YARN}) if "model.rope_scaling.type" in keys else None
    d = MLADims(H, keys["model.mla.q_lora_rank"], 6, 4, 2, 3, eps=1e-6, mscale=yarn.softmax_mscale() if yarn else 1.0)
    cos, sin = rope_tables(np, T, 2, 300.0, np.float64, yarn=yarn)
    moe = build_model(load_config(None, [
        "model.kind=llama", f"model.d_model={C}", f"model.n_heads={H}", f"model.n_layers={L}", f"model.seq_len={T}",
        "model.dtype=float64", f"model.moe.num_experts={E}", f"model.moe.top_k={K}", f"model.moe.expert_hidden={FE}",
        f"model.moe.shared_hidden={2 * FE}", f"model.moe.dense_layers={DENSE}", "model.moe.router=sigmoid",
        f"model.moe.n_groups={G}", f"model.moe.topk_groups={TG}", "model.moe.routed_scaling=2.5"]).model).moe
    moe.set_bias(np, np.stack([bias.get(i, np.zeros(E)) for i in range(L)]))
    x = P["wte"][ids]
    for i in range(L):
        p = f"h.{i}"
        h = rmsnorm_forward(np, x, P[f"{p}.attn_norm.w"], 1e-6)[0]
        W = {n[len(p) + 6:]: a for n, a in P.items() if n.startswith(f"{p}.attn.")}
        x = x + mla_forward(np, h, W, d, cos, sin)[0]
        h = rmsnorm_forward(np, x, P[f"{p}.mlp_norm.w"], 1e-6)[0]
        if i < DENSE:
            g, u = h @ P[f"{p}.mlp.gate.w"], h @ P[f"{p}.mlp.up.w"]
            x = x + (g / (1 + np.exp(-g)) * u) @ P[f"{p}.mlp.down.w"]
        else:
            x = x + moe.forward(np, P, p, h, LOCAL)[0]
    return rmsnorm_forward(np, x, P["norm.w"], 1e-6)[0] @ P["lm_head.w"]


def test_mapped_weights_give_transformers_logits(saved):
    case, hc, tensors, folder = saved
    keys = {**hf_deepseek.keys_from_hf(hc, "hf:x"), "model.mtp.depth": 0}
    P = {n: fn(tuple(tensors[h] for h in hf) if isinstance(hf, tuple) else tensors[hf])
         for n, (hf, fn) in hf_deepseek.from_hf_map(keys).items()}
    bias = {row: tensors[h] for row, h in hf_deepseek.bias_names(keys).items()}
    ids = np.random.default_rng(1).integers(0, V, (2, T))

    def hf_logits():                                   # built inside exact(): its rotary tables in float64 too
        model = DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager",
                                                      experts_implementation="eager").eval()
        return logits_of(torch, model, ids)

    want = exact(torch, hf_logits, modeling_deepseek_v3, modeling_rope_utils)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(hpengine_logits(P, bias, keys, ids), want, rtol=1e-10, atol=1e-10)
