"""planner/sizes.py's closed forms against transformers' DeepseekV3ForCausalLM built on the meta device (shapes
only, no memory): the parameters of the deepseek-v3 and kimi-k2 presets and of a tiny shape, with and without q
compression, and what a token activates (every tensor but the embedding, a routed layer's experts at top_k of
num_experts).

Needs the `hf` extra (torch, transformers >= 5); skipped without them.
"""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5")

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from hpengine.planner.presets import model_config  # noqa: E402
from hpengine.planner.sizes import MLAShape  # noqa: E402

TINY = MLAShape(vocab=10, d_model=4, n_layers=3, dense_layers=1, n_heads=2, q_lora_rank=3, kv_lora_rank=2, qk_nope=2,
                qk_rope=1, v_head=3, ffn_hidden=5, expert_hidden=2, experts=4, shared=1, top_k=2)


def hf_model(s: MLAShape):
    cfg = DeepseekV3Config(vocab_size=s.vocab, hidden_size=s.d_model, intermediate_size=s.ffn_hidden,
                           moe_intermediate_size=s.expert_hidden, num_hidden_layers=s.n_layers,
                           first_k_dense_replace=s.dense_layers, num_attention_heads=s.n_heads,
                           num_key_value_heads=s.n_heads, n_routed_experts=s.experts, n_shared_experts=s.shared,
                           num_experts_per_tok=s.top_k, n_group=s.n_groups, topk_group=s.topk_groups,
                           q_lora_rank=s.q_lora_rank or None, kv_lora_rank=s.kv_lora_rank,
                           qk_nope_head_dim=s.qk_nope, qk_rope_head_dim=s.qk_rope, v_head_dim=s.v_head,
                           tie_word_embeddings=False)
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(cfg)


SHAPES = {"tiny": TINY, "tiny_plain_q": dataclasses.replace(TINY, q_lora_rank=0),
          **{name: MLAShape.of(model_config(name)) for name in ("deepseek-v3", "kimi-k2")}}


@pytest.mark.parametrize("name", list(SHAPES))
def test_counts_equal_transformers(name):
    s = SHAPES[name]
    model = hf_model(s)
    total = sum(p.numel() for p in model.parameters())
    assert s.params() == total
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    idle = experts * (s.experts - s.top_k) // s.experts
    assert s.activated() == total - model.model.embed_tokens.weight.numel() - idle
