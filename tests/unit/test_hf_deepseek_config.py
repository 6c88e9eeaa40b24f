"""models/hf_deepseek.py without torch: DeepSeek-V3's published config.json (its fields typed in here) gives the
[model] keys that agree with the planner's deepseek-v3 preset (planner/presets.py, written from the paper), round
trips through hf_config, and names one Hugging Face tensor per hpengine tensor (MTP layer 61 included); what the
kind does not run is refused in one line. Against transformers: tests/interop/test_hf_deepseek_names.py."""
from __future__ import annotations

import pytest

from hpengine.models import hf_deepseek
from hpengine.models.hf_common import HFMismatch
from hpengine.planner.presets import model_config
from hpengine.planner.sizes import MLAShape

# deepseek-ai/DeepSeek-V3's config.json (architecture fields, quantization_config and auto_map left out)
PUBLISHED = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
             "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
             "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
             "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
             "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
             "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "max_position_embeddings": 163840,
             "initializer_range": 0.02, "rms_norm_eps": 1e-06, "rope_theta": 10000, "attention_bias": False,
             "attention_dropout": 0.0, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                        "type": "yarn"},
             "tie_word_embeddings": False, "vocab_size": 129280, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}


def test_published_config_agrees_with_the_preset():
    keys = hf_deepseek.keys_from_hf(PUBLISHED, "hf:v3")
    s = MLAShape.of(model_config("deepseek-v3"))
    want = {"model.vocab_size": s.vocab, "model.d_model": s.d_model, "model.n_layers": s.n_layers,
            "model.moe.dense_layers": s.dense_layers, "model.n_heads": s.n_heads, "model.mla.q_lora_rank": s.q_lora_rank,
            "model.mla.kv_lora_rank": s.kv_lora_rank, "model.mla.qk_nope_head_dim": s.qk_nope,
            "model.mla.qk_rope_head_dim": s.qk_rope, "model.mla.v_head_dim": s.v_head, "model.ffn_hidden": s.ffn_hidden,
            "model.moe.expert_hidden": s.expert_hidden, "model.moe.num_experts": s.experts,
            "model.moe.shared_hidden": s.shared * s.expert_hidden, "model.moe.top_k": s.top_k,
            "model.moe.n_groups": s.n_groups, "model.moe.topk_groups": s.topk_groups, "model.mtp.depth": s.mtp_depth,
            "model.rope_scaling.original_max_position_embeddings": model_config("deepseek-v3").seq_len}
    assert {k: keys[k] for k in want} == want
    assert keys["model.rope_scaling.type"] == "yarn" and keys["model.rope_scaling.factor"] == 40.0
    assert keys["model.moe.router"] == "sigmoid" and keys["model.moe.routed_scaling"] == 2.5
    assert keys["model.tie_head"] is False and keys["model.rope_theta"] == 10000.0
    back = hf_deepseek.hf_config({**keys, "model.seq_len": 163840}, "bfloat16", 1)
    assert hf_deepseek.keys_from_hf(back, "hf:again") == keys
    for field in ("hidden_size", "n_routed_experts", "n_shared_experts", "q_lora_rank", "first_k_dense_replace",
                  "num_nextn_predict_layers", "max_position_embeddings"):
        assert back[field] == PUBLISHED[field], field
    assert {**back["rope_parameters"], "type": "yarn"} == {**PUBLISHED["rope_scaling"], "rope_theta": 10000.0,
                                                           "rope_type": "yarn"}


def test_published_names():
    keys = hf_deepseek.keys_from_hf(PUBLISHED, "hf:v3")
    plain, experts = hf_deepseek.names(keys), hf_deepseek.expert_names(keys)
    mtp, mtp_experts = hf_deepseek.mtp_names(keys)
    hf = ([h for h, _ in plain.values()] + [h for hs in experts.values() for h in hs] + [h for h, _ in mtp.values()]
          + [h for hs in mtp_experts.values() for h in hs] + list(hf_deepseek.mtp_copies(keys))
          + list(hf_deepseek.bias_names(keys).values()))
    assert len(hf) == len(set(hf))
    # per layer: 2 norms, 5 attention tensors with q compression (q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o: 7);
    # dense: 3 matrices; routed: router, its bias, 3 shared matrices, 3 x 256 expert matrices
    dense, routed = 2 + 7 + 3, 2 + 7 + 2 + 3 + 3 * 256
    assert len(hf) == 3 + 3 * dense + 58 * routed + routed + 6       # + MTP layer 61: a routed block and its 6
    assert plain["h.60.attn.kv_a.w"] == ("model.layers.60.self_attn.kv_a_proj_with_mqa.weight", True)
    assert experts["h.3.moe.experts.down.w"][255] == "model.layers.3.mlp.experts.255.down_proj.weight"
    assert mtp["mtp.0.eh_proj.w"] == ("model.layers.61.eh_proj.weight", True)
    assert mtp["mtp.0.moe.router.w"] == ("model.layers.61.mlp.gate.weight", True)
    assert "h.2.moe.router.w" not in plain and "h.2.mlp.gate.w" in plain


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'; hpengine's deepseek kind runs only 'silu'"),
    ({"rope_interleave": False}, "rope_interleave False"),
    ({"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy'"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"num_key_value_heads": 1}, "num_key_value_heads 1; hpengine's deepseek kind runs only 128"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ({"rope_scaling": {"type": "yarn", "factor": 40}}, "YaRN without original_max_position_embeddings"),
    ({"rope_scaling": {**PUBLISHED["rope_scaling"], "attention_factor": 1.2}}, "rope_parameters.attention_factor 1.2"),
])
def test_refused(change, message):
    with pytest.raises(HFMismatch, match=message) as exc:
        hf_deepseek.keys_from_hf({**PUBLISHED, **change}, "hf:v3")
    assert "\n" not in str(exc.value) and "hf:v3" in str(exc.value)


def test_export_refusal():
    keys = hf_deepseek.keys_from_hf(PUBLISHED, "hf:v3")
    assert hf_deepseek.export_refusal(keys) == ""
    assert "router = 'sigmoid'" in hf_deepseek.export_refusal({**keys, "model.moe.router": "softmax"})
    assert "multiple of model.moe.expert_hidden" in hf_deepseek.export_refusal({**keys, "model.moe.shared_hidden": 3000})
