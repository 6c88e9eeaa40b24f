"""The llama kind's Hugging Face adapter, both directions: LlamaForCausalLM's (or, with routed experts,
MixtralForCausalLM's) config.json and state dict from hpengine's parameters (export), and the name map and
config checks to start from such a folder.

Mixtral on disk (what transformers' save_pretrained writes, and reads back into its fused (E, 2F, C)
gate_up_proj): per layer block_sparse_moe.gate.weight (E, C), the router, and per expert e
block_sparse_moe.experts.{e}.w1 / w3 / w2.weight, the gate, up and down projections as (out, in)."""
from __future__ import annotations

import numpy as np

from hpengine.config.load import ffn_width
from hpengine.models.hf_common import HFMismatch, common_config, want

ARCH, MOE_ARCH = "LlamaForCausalLM", "MixtralForCausalLM"
ARCHS = (ARCH, MOE_ARCH)
_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}


def export_refusal(mcfg) -> str:
    """Why this config has no Hugging Face equivalent ("" when it has one)."""
    return mixtral_refusal(mcfg) if mcfg.moe.num_experts else ""


def mixtral_refusal(mcfg) -> str:
    """Why an MoE config is no MixtralForCausalLM ("" when it is one)."""
    e = mcfg.moe
    bad = [what for what, ok in (("model.moe.dense_layers = 0 (Mixtral routes every layer)", e.dense_layers == 0),
                                 ("model.moe.shared_hidden = 0 (no shared expert)", e.shared_hidden == 0),
                                 ("model.moe.router = 'softmax'", e.router == "softmax"),
                                 ("model.moe.norm_topk = true", e.norm_topk)) if not ok]
    return ("a MixtralForCausalLM needs " + ", ".join(bad)) if bad else ""


def names(mcfg) -> dict:
    """hpengine llama name -> (Hugging Face name, transposed), every tensor but the experts' (expert_names)."""
    m = {"wte": ("model.embed_tokens.weight", False), "norm.w": ("model.norm.weight", False)}
    if not mcfg.tie_head:
        m["lm_head.w"] = ("lm_head.weight", True)
    for i in range(mcfg.n_layers):
        p, q = f"h.{i}", f"model.layers.{i}"
        m[f"{p}.attn_norm.w"] = (f"{q}.input_layernorm.weight", False)
        m[f"{p}.mlp_norm.w"] = (f"{q}.post_attention_layernorm.weight", False)
        for a in "qkvo":
            m[f"{p}.attn.{a}.w"] = (f"{q}.self_attn.{a}_proj.weight", True)
        if mcfg.moe.num_experts:
            m[f"{p}.moe.router.w"] = (f"{q}.block_sparse_moe.gate.weight", True)
            continue
        for a in ("gate", "up", "down"):
            m[f"{p}.mlp.{a}.w"] = (f"{q}.mlp.{a}_proj.weight", True)
    return m


def expert_names(mcfg) -> dict:
    """hpengine expert tensor (E, in, out) -> the Hugging Face names of its experts' (out, in) matrices, in order."""
    return {f"h.{i}.moe.experts.{a}.w": [f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"
                                         for e in range(mcfg.moe.num_experts)]
            for i in range(mcfg.n_layers if mcfg.moe.num_experts else 0) for a, w in _EXPERT.items()}


def to_hf(P: dict, mcfg) -> dict:
    """hpengine llama parameters -> LlamaForCausalLM's (MixtralForCausalLM's) state dict (numpy; its linears
    are (out, in))."""
    out = {hf: np.ascontiguousarray(P[n].T if t else P[n]) for n, (hf, t) in names(mcfg).items()}
    for n, hfs in expert_names(mcfg).items():
        out.update({hf: np.ascontiguousarray(P[n][e].T) for e, hf in enumerate(hfs)})
    return out


def hf_config(mcfg, dtype: str, eos: int | None) -> dict:
    """config.json of the LlamaForCausalLM (MixtralForCausalLM) for model config mcfg."""
    e = mcfg.moe
    moe = ({"architectures": [MOE_ARCH], "model_type": "mixtral", "intermediate_size": e.expert_hidden or ffn_width(mcfg),
            "num_local_experts": e.num_experts, "num_experts_per_tok": e.top_k, "router_aux_loss_coef": e.aux_loss,
            "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": None}
           if e.num_experts else {})
    return {"architectures": [ARCH], "model_type": "llama", "hidden_size": mcfg.d_model,
            "intermediate_size": ffn_width(mcfg), "num_hidden_layers": mcfg.n_layers,
            "num_attention_heads": mcfg.n_heads, "num_key_value_heads": mcfg.n_kv_heads or mcfg.n_heads,
            "head_dim": mcfg.d_model // mcfg.n_heads, "hidden_act": "silu",
            "max_position_embeddings": mcfg.seq_len, "rope_theta": mcfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": mcfg.rope_theta},
            "rms_norm_eps": mcfg.norm_eps, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "initializer_range": mcfg.init_std, **common_config(mcfg, dtype, eos), **moe}


def check_config(hc: dict, mcfg, where: str) -> bool:
    """Raise HFMismatch when a Llama config.json's shape differs from [model]; returns whether it is tied."""
    H = hc.get("num_attention_heads")
    want("hidden_size", hc.get("hidden_size"), mcfg.d_model, "d_model", where)
    want("num_hidden_layers", hc.get("num_hidden_layers"), mcfg.n_layers, "n_layers", where)
    want("num_attention_heads", H, mcfg.n_heads, "n_heads", where)
    want("num_key_value_heads", hc.get("num_key_value_heads") or H, mcfg.n_kv_heads or mcfg.n_heads, "n_kv_heads",
         where)
    arch = (hc.get("architectures") or [ARCH])[0]
    e = mcfg.moe
    if arch == MOE_ARCH:
        if not e.num_experts or mixtral_refusal(mcfg):
            raise HFMismatch(f"{where} is a {MOE_ARCH}, but " + (mixtral_refusal(mcfg) or
                             "model.moe.num_experts = 0 (a dense model): set [model.moe] to its experts"))
        want("num_local_experts", hc.get("num_local_experts"), e.num_experts, "moe.num_experts", where)
        want("num_experts_per_tok", hc.get("num_experts_per_tok"), e.top_k, "moe.top_k", where)
        want("intermediate_size", hc.get("intermediate_size"), e.expert_hidden or ffn_width(mcfg),
             "moe.expert_hidden (each expert's SwiGLU width)", where)
    elif e.num_experts:
        raise HFMismatch(f"{where} is a dense {arch}, but model.moe.num_experts = {e.num_experts}")
    else:
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
    """hpengine llama name -> (Hugging Face name, or the tuple of them a tensor is stacked from; the transform of
    the HF array, or of the list of them)."""
    out = {n: (hf, (lambda a: a.T) if t else (lambda a: a)) for n, (hf, t) in names(mcfg).items()}
    out.update({n: (tuple(hfs), lambda arrs: np.stack([a.T for a in arrs])) for n, hfs in expert_names(mcfg).items()})
    return out
