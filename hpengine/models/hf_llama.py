"""The llama kind's Hugging Face adapter, both directions: LlamaForCausalLM's config.json and state dict
from hpengine's parameters (export), and the name map and config checks to start from a Llama folder."""
from __future__ import annotations

import numpy as np

from hpengine.config.load import ffn_width
from hpengine.models.hf_common import HFMismatch, common_config, want

ARCH = "LlamaForCausalLM"


def names(n_layers: int, tied: bool) -> dict:
    """hpengine llama name -> (Hugging Face name, transposed)."""
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


def to_hf(P: dict, mcfg) -> dict:
    """hpengine llama parameters -> LlamaForCausalLM's state dict (numpy; its linears are (out, in))."""
    return {hf: np.ascontiguousarray(P[n].T if t else P[n]) for n, (hf, t) in names(mcfg.n_layers, mcfg.tie_head).items()}


def hf_config(mcfg, dtype: str, eos: int | None) -> dict:
    """config.json of the LlamaForCausalLM for model config mcfg."""
    return {"architectures": [ARCH], "model_type": "llama", "hidden_size": mcfg.d_model,
            "intermediate_size": ffn_width(mcfg), "num_hidden_layers": mcfg.n_layers,
            "num_attention_heads": mcfg.n_heads, "num_key_value_heads": mcfg.n_kv_heads or mcfg.n_heads,
            "head_dim": mcfg.d_model // mcfg.n_heads, "hidden_act": "silu",
            "max_position_embeddings": mcfg.seq_len, "rope_theta": mcfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": mcfg.rope_theta},
            "rms_norm_eps": mcfg.norm_eps, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "initializer_range": mcfg.init_std, **common_config(mcfg, dtype, eos)}


def check_config(hc: dict, mcfg, where: str) -> bool:
    """Raise HFMismatch when a Llama config.json's shape differs from [model]; returns whether it is tied."""
    H = hc.get("num_attention_heads")
    want("hidden_size", hc.get("hidden_size"), mcfg.d_model, "d_model", where)
    want("num_hidden_layers", hc.get("num_hidden_layers"), mcfg.n_layers, "n_layers", where)
    want("num_attention_heads", H, mcfg.n_heads, "n_heads", where)
    want("num_key_value_heads", hc.get("num_key_value_heads") or H, mcfg.n_kv_heads or mcfg.n_heads, "n_kv_heads",
         where)
    want("intermediate_size", hc.get("intermediate_size"), ffn_width(mcfg), "ffn_hidden (SwiGLU width)", where)
    want("vocab_size", hc.get("vocab_size"), mcfg.vocab_size, "vocab_size", where)
    if hc.get("head_dim") is not None:
        want("head_dim", hc["head_dim"], mcfg.d_model // mcfg.n_heads, "d_model / model.n_heads", where)
    rope = hc.get("rope_parameters") or hc.get("rope_scaling") or {}
    theta = hc.get("rope_theta", rope.get("rope_theta", 10000.0))
    want("rope_theta", float(theta), float(mcfg.rope_theta), "rope_theta", where)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise HFMismatch(f"{where} has rope_type {rope.get('rope_type', rope.get('type'))!r}; "
                         "hpengine's llama supports only the default rotary embedding")
    want("rms_norm_eps", hc.get("rms_norm_eps", 1e-6), mcfg.norm_eps, "norm_eps", where)
    for flag in ("attention_bias", "mlp_bias"):
        if hc.get(flag):
            raise HFMismatch(f"{where} has {flag} = true; hpengine's llama has no biases")
    act = hc.get("hidden_act", "silu")
    if act != "silu":
        raise HFMismatch(f"{where} has hidden_act {act!r}; hpengine's llama uses 'silu'")
    return bool(hc.get("tie_word_embeddings", False))


def full_names(entries: dict) -> dict:
    """A folder's tensors under LlamaForCausalLM's names (they already are)."""
    return entries


def from_hf_map(mcfg) -> dict:
    """hpengine llama name -> (Hugging Face name, transform of the HF array)."""
    return {n: (hf, (lambda a: a.T) if t else (lambda a: a)) for n, (hf, t) in names(mcfg.n_layers, mcfg.tie_head).items()}
