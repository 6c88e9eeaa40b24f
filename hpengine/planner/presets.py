"""Published model shapes for `hpengine plan --model NAME`: each preset is a [model] table (its kind and
that kind's keys; every other key stays at its default) and a global batch in sequences."""
from __future__ import annotations

from dataclasses import dataclass

from hpengine.config.tree import MLAConfig, ModelConfig, MoEConfig, MTPConfig


@dataclass(frozen=True)
class Preset:
    model: dict            # [model] keys, kind included
    global_batch: int      # sequences per optimizer step


def _gpt(seq_len: int, d_model: int, n_layers: int, n_heads: int, batch: int) -> Preset:
    """GPT-2 / GPT-3: the 50257-token BPE vocabulary, a 4 x d_model MLP, the head tied to the embedding."""
    return Preset({"kind": "gpt", "vocab_size": 50257, "ffn_mult": 4, "tie_head": True, "seq_len": seq_len,
                   "d_model": d_model, "n_layers": n_layers, "n_heads": n_heads}, batch)


def _llama(d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, tied: bool,
           batch: int) -> Preset:
    """Llama 3 / 3.2: the 128256-token vocabulary, 8192-token pretraining context, rotary base 500000,
    RMSNorm epsilon 1e-5, grouped-query attention and an explicit SwiGLU width."""
    return Preset({"kind": "llama", "vocab_size": 128256, "seq_len": 8192, "d_model": d_model, "n_layers": n_layers,
                   "n_heads": n_heads, "n_kv_heads": n_kv_heads, "ffn_hidden": ffn_hidden, "rope_theta": 500000.0,
                   "norm_eps": 1e-5, "tie_head": tied}, batch)


def _mixtral(n_layers: int, experts: int, top_k: int, batch: int) -> Preset:
    """Mixtral 8x7B (Jiang et al. 2024; Hugging Face config.json): Mistral 7B's attention (4096 wide, 32 query
    and 8 key/value heads, rotary base 1e6, a 32000-token vocabulary) with every layer's MLP replaced by routed
    SwiGLU experts of width 14336, top 2 of 8, renormalised. Trained at 4096 tokens here (its window)."""
    return Preset({"kind": "llama", "vocab_size": 32000, "seq_len": 4096, "d_model": 4096, "n_layers": n_layers,
                   "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336, "rope_theta": 1e6, "norm_eps": 1e-5,
                   "moe": {"num_experts": experts, "top_k": top_k, "expert_hidden": 14336}}, batch)


def _deepseek(heads: int, vocab: int, dense: int, experts: int, groups: int, topk_groups: int, mtp: int,
              theta: float, scaling: float, batch: int) -> Preset:
    """DeepSeek-V3 and Kimi K2 (Hugging Face config.json): 61 layers of width 7168, MLA with q_lora_rank 1536,
    kv_lora_rank 512, 128 + 64 wide query/key heads and 128 wide value heads; dense SwiGLU MLPs of 18432, routed
    experts of 2048, top 8 of sigmoid scores (renormalised, times routed_scaling) beside one shared expert of 2048;
    RMSNorm epsilon 1e-6, untied head; pretrained at 4096 tokens (the YaRN extension to 128K comes after: not
    planned here). Aux-loss-free balancing at DeepSeek-V3's rate 0.001 beside its sequence-wise loss of 0.0001."""
    return Preset({"kind": "deepseek", "vocab_size": vocab, "seq_len": 4096, "d_model": 7168, "n_layers": 61,
                   "n_heads": heads, "ffn_hidden": 18432, "rope_theta": theta, "norm_eps": 1e-6, "tie_head": False,
                   "mla": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                           "v_head_dim": 128},
                   "moe": {"num_experts": experts, "top_k": 8, "expert_hidden": 2048, "shared_hidden": 2048,
                           "dense_layers": dense, "router": "sigmoid", "n_groups": groups, "topk_groups": topk_groups,
                           "routed_scaling": scaling, "bias_update_rate": 0.001, "aux_loss": 0.0001},
                   "mtp": {"depth": mtp}}, batch)


PRESETS = {
    # GPT-2 small and GPT-3 shapes (Brown et al. 2020, table 2.1; 1.3B with 16 heads so heads divide d_model)
    "gpt2-124m": _gpt(1024, 768, 12, 12, 512),
    "1.3b": _gpt(2048, 2048, 24, 16, 512),
    "7b": _gpt(2048, 4096, 32, 32, 1024),
    "13b": _gpt(2048, 5120, 40, 40, 1024),
    "175b": _gpt(2048, 12288, 96, 96, 1536),
    # Llama 3 and 3.2 shapes from Meta's model cards and Hugging Face config.json (3.2 1B ties its head; the
    # 3.2 context extension by rope scaling is left out). Meta publishes no batch for these sizes: 512 x 8192
    # = 4M tokens is Llama 2's for every size (Touvron et al. 2023, table 1) and Llama 3 405B's first
    # (Llama 3 Herd of Models 2024, section 3.4.1); the 1B takes half of it
    "llama3-8b": _llama(4096, 32, 32, 8, 14336, False, 512),
    "llama3-70b": _llama(8192, 80, 64, 8, 28672, False, 512),
    "llama3.2-1b": _llama(2048, 16, 32, 8, 8192, True, 256),
    # Mistral publishes no batch: 1024 x 4096 = 4M tokens, the llama presets' token count
    "mixtral-8x7b": _mixtral(32, 8, 2, 1024),
    # DeepSeek-V3 (DeepSeek-AI 2024, sections 2 and 4.2): 128 heads, 3 dense layers, 256 experts in 8 groups, 4 open
    # per token, one MTP module; the batch grows to 15360 sequences and stays there
    "deepseek-v3": _deepseek(128, 129280, 3, 256, 8, 4, 1, 10000.0, 2.5, 15360),
    # Kimi K2 (Moonshot AI 2025): half the heads, 1 dense layer, 384 experts without groups, a 163840-token
    # vocabulary, rotary base 50000, no MTP module; 67M tokens a step
    "kimi-k2": _deepseek(64, 163840, 1, 384, 1, 1, 0, 50000.0, 2.827, 16384),
}
ALIASES = {"124m": "gpt2-124m", "gpt2": "gpt2-124m", "6.7b": "7b"}

_TABLES = {"moe": MoEConfig, "mtp": MTPConfig, "mla": MLAConfig}


def model_config(name: str) -> ModelConfig:
    """The [model] config of the preset `name` (a key of PRESETS)."""
    return ModelConfig(**{k: _TABLES[k](**v) if k in _TABLES else v for k, v in PRESETS[name].model.items()})
