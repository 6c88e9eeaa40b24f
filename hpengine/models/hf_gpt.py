"""The gpt kind's Hugging Face adapter, both directions: GPT2LMHeadModel's config.json and state dict from
hpengine's parameters (export), and the name map and config checks to start from a GPT-2 folder (import)."""
from __future__ import annotations

import numpy as np

from hpengine.models.hf_common import HFMismatch, common_config, want

ARCH = "GPT2LMHeadModel"


def qkv_to_hf(a: np.ndarray, n_heads: int) -> np.ndarray:
    """hpengine's head-major fused qkv (columns [h][q,k,v][d]) -> GPT-2's c_attn ([q,k,v][h][d]); the last
    axis is permuted, so this serves the (C, 3C) weight and the (3C,) bias."""
    n = a.shape[-1]
    hd = n // (3 * n_heads)
    lead = a.shape[:-1]
    return np.ascontiguousarray(a.reshape(*lead, n_heads, 3, hd).swapaxes(-3, -2).reshape(*lead, n))


def qkv_from_hf(a: np.ndarray, n_heads: int) -> np.ndarray:
    """GPT-2's c_attn columns ([q,k,v][h][d]) -> hpengine's head-major fused qkv ([h][q,k,v][d]); the
    inverse of qkv_to_hf, on the last axis (the (C, 3C) weight and the (3C,) bias)."""
    n = a.shape[-1]
    hd = n // (3 * n_heads)
    lead = a.shape[:-1]
    return np.ascontiguousarray(a.reshape(*lead, 3, n_heads, hd).swapaxes(-3, -2).reshape(*lead, n))


_PAIRS = (("ln1", "ln_1"), ("ln2", "ln_2"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
          ("mlp.proj", "mlp.c_proj"))


def export_refusal(mcfg) -> str:
    """Why this config has no Hugging Face equivalent: every gpt config has one (GPT2LMHeadModel)."""
    return ""


def to_hf(P: dict, mcfg) -> dict:
    """hpengine gpt parameters -> GPT2LMHeadModel's state dict (numpy)."""
    H = mcfg.n_heads
    out = {"transformer.wte.weight": P["wte"], "transformer.wpe.weight": P["wpe"],
           "transformer.ln_f.weight": P["ln_f.w"], "transformer.ln_f.bias": P["ln_f.b"]}
    if not mcfg.tie_head:
        out["lm_head.weight"] = P["lm_head.w"].T
    for i in range(mcfg.n_layers):
        p, q = f"h.{i}", f"transformer.h.{i}"
        out[f"{q}.attn.c_attn.weight"] = qkv_to_hf(P[f"{p}.attn.qkv.w"], H)
        out[f"{q}.attn.c_attn.bias"] = qkv_to_hf(P[f"{p}.attn.qkv.b"], H)
        for ours, theirs in _PAIRS:
            out[f"{q}.{theirs}.weight"], out[f"{q}.{theirs}.bias"] = P[f"{p}.{ours}.w"], P[f"{p}.{ours}.b"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def hf_config(mcfg, dtype: str, eos: int | None) -> dict:
    """config.json of the GPT2LMHeadModel for model config mcfg."""
    return {"architectures": [ARCH], "model_type": "gpt2", "n_embd": mcfg.d_model,
            "n_layer": mcfg.n_layers, "n_head": mcfg.n_heads, "n_inner": mcfg.ffn_mult * mcfg.d_model,
            "n_positions": mcfg.seq_len, "n_ctx": mcfg.seq_len, "layer_norm_epsilon": 1e-5,
            "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "summary_first_dropout": 0.0, "scale_attn_weights": True, "reorder_and_upcast_attn": False,
            "scale_attn_by_inverse_layer_idx": False, **common_config(mcfg, dtype, eos)}


def check_config(hc: dict, mcfg, where: str) -> bool:
    """Raise HFMismatch when a GPT-2 config.json's shape differs from [model]; returns whether it is tied."""
    C = hc.get("n_embd", 768)
    want("n_embd", C, mcfg.d_model, "d_model", where)
    want("n_layer", hc.get("n_layer", 12), mcfg.n_layers, "n_layers", where)
    want("n_head", hc.get("n_head", 12), mcfg.n_heads, "n_heads", where)
    want("n_inner", hc.get("n_inner") or 4 * C, mcfg.ffn_mult * mcfg.d_model, "ffn_mult * d_model", where)
    want("vocab_size", hc.get("vocab_size", 50257), mcfg.vocab_size, "vocab_size", where)
    npos = hc.get("n_positions", 1024)
    if npos < mcfg.seq_len:
        raise HFMismatch(f"{where} has n_positions {npos} but model.seq_len = {mcfg.seq_len} (at most n_positions)")
    act = hc.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HFMismatch(f"{where} has activation_function {act!r}; hpengine's gpt uses 'gelu_new'")
    eps = hc.get("layer_norm_epsilon", 1e-5)
    if eps != 1e-5:
        raise HFMismatch(f"{where} has layer_norm_epsilon {eps}; hpengine's gpt LayerNorm uses 1e-05")
    return bool(hc.get("tie_word_embeddings", True))


def full_names(entries: dict) -> dict:
    """A folder's tensors under GPT2LMHeadModel's names: a bare GPT2Model's ("wte.weight") gain "transformer."."""
    if "transformer.wte.weight" not in entries and "wte.weight" in entries:
        return {f"transformer.{k}": v for k, v in entries.items()}
    return entries


def from_hf_map(mcfg) -> dict:
    """hpengine gpt name -> (Hugging Face name, transform of the HF array)."""
    H = mcfg.n_heads
    same = lambda a: a                                      # noqa: E731
    m = {"wte": ("transformer.wte.weight", same), "wpe": ("transformer.wpe.weight", lambda a: a[:mcfg.seq_len]),
         "ln_f.w": ("transformer.ln_f.weight", same), "ln_f.b": ("transformer.ln_f.bias", same)}
    if not mcfg.tie_head:
        m["lm_head.w"] = ("lm_head.weight", lambda a: a.T)
    qkv = lambda a: qkv_from_hf(a, H)                       # noqa: E731
    for i in range(mcfg.n_layers):
        p, q = f"h.{i}", f"transformer.h.{i}"
        m[f"{p}.attn.qkv.w"] = (f"{q}.attn.c_attn.weight", qkv)
        m[f"{p}.attn.qkv.b"] = (f"{q}.attn.c_attn.bias", qkv)
        for ours, theirs in _PAIRS:
            m[f"{p}.{ours}.w"] = (f"{q}.{theirs}.weight", same)
            m[f"{p}.{ours}.b"] = (f"{q}.{theirs}.bias", same)
    return m
