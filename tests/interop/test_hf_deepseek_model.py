"""The deepseek kind's whole forward against Hugging Face's DeepseekV3ForCausalLM on the same weights (a dense first
layer, then routed layers with grouped sigmoid routing, routed scaling and a shared expert; MLA with and without the
query bottleneck, default rope and YaRN): float64 logits agree to 1e-10.

Needs the `hf` extra (torch, transformers >= 5 with DeepseekV3); skipped without them.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")
deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

from transformers import DeepseekV3Config, modeling_rope_utils  # noqa: E402

from hf_oracle import exact, logits_of  # noqa: E402
from hpengine.config.load import load_config  # noqa: E402
from hpengine.models import LOCAL, build_model  # noqa: E402
from hpengine.params.buffers import FlatBuffer, Layout  # noqa: E402
from hpengine.params.init import init_flat  # noqa: E402

B, T, V, C, H, L, E, K, F, FD, G, TG, SCALE, THETA = 2, 9, 50, 16, 4, 3, 8, 2, 6, 20, 4, 2, 2.5, 300.0
YARN = {"factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 8.0, "beta_slow": 1.0, "mscale": 0.9,
        "mscale_all_dim": 1.2}
ATT = {"q.w": "q_proj", "q_a.w": "q_a_proj", "q_a_norm.w": "q_a_layernorm", "q_b.w": "q_b_proj",
       "kv_a.w": "kv_a_proj_with_mqa", "kv_a_norm.w": "kv_a_layernorm", "kv_b.w": "kv_b_proj", "o.w": "o_proj"}


def ours(q_lora_rank, yarn):
    rope = [f"model.rope_scaling.{k}={v}" for k, v in YARN.items()] + ["model.rope_scaling.type=yarn"] if yarn else []
    mc = load_config(None, [
        "model.kind=deepseek", f"model.vocab_size={V}", f"model.seq_len={T}", f"model.d_model={C}",
        f"model.n_layers={L}", f"model.n_heads={H}", f"model.ffn_hidden={FD}", f"model.rope_theta={THETA}",
        "model.norm_eps=1e-6", "model.dtype=float64", f"model.mla.q_lora_rank={q_lora_rank}",
        "model.mla.kv_lora_rank=6", "model.mla.qk_nope_head_dim=4", "model.mla.qk_rope_head_dim=6",
        "model.mla.v_head_dim=5", f"model.moe.num_experts={E}", f"model.moe.top_k={K}",
        f"model.moe.expert_hidden={F}", f"model.moe.shared_hidden={F}", "model.moe.dense_layers=1",
        "model.moe.router=sigmoid", f"model.moe.n_groups={G}", f"model.moe.topk_groups={TG}",
        f"model.moe.routed_scaling={SCALE}", *rope]).model
    m = build_model(mc)
    lay = Layout(m.all_specs(), 0, 1)
    P = FlatBuffer(lay, np, np.float64)
    init_flat(P, 3)
    P.data[:] += np.random.default_rng(4).standard_normal(P.data.size) * 0.3
    return m, P


def hf_model(P, q_lora_rank, yarn):
    rope = {"rope_theta": THETA, **({"rope_type": "yarn", **YARN} if yarn else {"rope_type": "default"})}
    cfg = DeepseekV3Config(vocab_size=V, hidden_size=C, intermediate_size=FD, moe_intermediate_size=F,
                           num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=H, n_shared_experts=1,
                           n_routed_experts=E, num_experts_per_tok=K, n_group=G, topk_group=TG, norm_topk_prob=True,
                           routed_scaling_factor=SCALE, first_k_dense_replace=1, q_lora_rank=q_lora_rank or None,
                           kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=6, v_head_dim=5, rms_norm_eps=1e-6,
                           max_position_embeddings=T, rope_parameters=rope, tie_word_embeddings=False,
                           attention_bias=False, attn_implementation="eager", experts_implementation="eager")
    hf = deepseek.DeepseekV3ForCausalLM(cfg).double()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(t(P["wte"]))
        hf.model.norm.weight.copy_(t(P["norm.w"]))
        hf.lm_head.weight.copy_(t(P["lm_head.w"].T))
        for i, layer in enumerate(hf.model.layers):
            p = f"h.{i}."
            layer.input_layernorm.weight.copy_(t(P[p + "attn_norm.w"]))
            layer.post_attention_layernorm.weight.copy_(t(P[p + "mlp_norm.w"]))
            for n, hn in ATT.items():
                if p + "attn." + n in P.views:
                    a = P[p + "attn." + n]
                    getattr(layer.self_attn, hn).weight.copy_(t(a.T if a.ndim == 2 else a))
            if i == 0:
                for n in ("gate", "up", "down"):
                    getattr(layer.mlp, f"{n}_proj").weight.copy_(t(P[p + f"mlp.{n}.w"].T))
                continue
            moe = layer.mlp
            moe.gate.weight.copy_(t(P[p + "moe.router.w"].T))
            moe.gate.e_score_correction_bias.zero_()
            gate_up = np.concatenate([P[p + "moe.experts.gate.w"], P[p + "moe.experts.up.w"]], axis=2)
            moe.experts.gate_up_proj.copy_(t(gate_up.transpose(0, 2, 1)))
            moe.experts.down_proj.copy_(t(P[p + "moe.experts.down.w"].transpose(0, 2, 1)))
            for n in ("gate", "up", "down"):
                getattr(moe.shared_experts, f"{n}_proj").weight.copy_(t(P[p + f"moe.shared.{n}.w"].T))
    return hf


@pytest.mark.parametrize("q_lora_rank", [5, 0])
@pytest.mark.parametrize("yarn", [False, True])
def test_deepseek_kind_equals_deepseek_v3_for_causal_lm(q_lora_rank, yarn):
    m, P = ours(q_lora_rank, yarn)
    ids = np.random.default_rng(1).integers(0, V, (B, T))
    x, _ = m.embed_forward(np, P, ids, LOCAL)
    for i in range(L):
        x, _ = m.layer_forward(np, P, i, x, LOCAL)
    got = m.head_logits(np, P, x)
    # built inside exact(): the rotary tables are made at construction
    want = exact(torch, lambda: logits_of(torch, hf_model(P, q_lora_rank, yarn), ids), deepseek, modeling_rope_utils)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
