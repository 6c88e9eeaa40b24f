"""The llama kind's Hugging Face adapter, both directions: the config.json and state dict of the transformers
class a model config is (export), and the name map and config checks to start from such a folder (import).
"""
from __future__ import annotations

import numpy as np

from hpengine.config.load import ffn_width, head_width
from hpengine.models.hf_common import HFMismatch, common_config, want

ARCH, MOE_ARCH = "LlamaForCausalLM", "MixtralForCausalLM"
QWEN3_ARCH, QWEN3_MOE_ARCH = "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
ARCHS = (ARCH, MOE_ARCH, QWEN3_ARCH, QWEN3_MOE_ARCH)
# architectures close to these that a folder may be, and why none of them loads
REFUSED = {"Qwen2MoeForCausalLM": "its shared expert is scaled by a learned sigmoid gate (shared_expert_gate), which "
                                  "hpengine's shared expert (model.moe.shared_hidden) does not have"}
# On disk (what transformers' save_pretrained writes, and reads back into its fused
# (E, 2F, C) gate_up_proj) an MoE layer holds its router as one (E, C) matrix and each expert e's gate, up and
# down projections as (out, in) matrices: Mixtral's block_sparse_moe.gate and block_sparse_moe.experts.{e}.w1 /
# w3 / w2, Qwen3-MoE's mlp.gate and mlp.experts.{e}.gate_proj / up_proj / down_proj.
_EXPERT = {MOE_ARCH: {"gate": "w1", "up": "w3", "down": "w2"},
           QWEN3_MOE_ARCH: {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}}
_MOE_BLOCK = {MOE_ARCH: "block_sparse_moe", QWEN3_MOE_ARCH: "mlp"}


# The class follows from two switches (arch_of): routed experts (model.moe.num_experts) and per-head q/k norms
# (model.qk_norm). Neither: LlamaForCausalLM; experts only: MixtralForCausalLM; q/k norms only: Qwen3ForCausalLM;
# both: Qwen3MoeForCausalLM.
def arch_of(mcfg) -> str:
    """The transformers class of a llama-kind model config."""
    if getattr(mcfg, "qk_norm", False):
        return QWEN3_MOE_ARCH if mcfg.moe.num_experts else QWEN3_ARCH
    return MOE_ARCH if mcfg.moe.num_experts else ARCH


def export_refusal(mcfg) -> str:
    """Why this config has no Hugging Face equivalent ("" when it has one)."""
    if mcfg.moe.num_experts and mcfg.moe.bias_update_rate > 0:      # its router biases change the chosen experts
        return f"{arch_of(mcfg)} has no router selection bias: needs model.moe.bias_update_rate = 0"
    arch = arch_of(mcfg)
    if mcfg.mtp.depth:      # no transformers llama-family class holds multi-token prediction modules
        return f"{arch} has no multi-token prediction modules: needs model.mtp.depth = 0"
    return mixtral_refusal(mcfg) if arch == MOE_ARCH else qwen3_moe_refusal(mcfg) if arch == QWEN3_MOE_ARCH else ""


def _needs(arch: str, checks) -> str:
    bad = [what for what, ok in checks if not ok]
    return (f"a {arch} needs " + ", ".join(bad)) if bad else ""


def mixtral_refusal(mcfg) -> str:
    """Why an MoE config is no MixtralForCausalLM ("" when it is one)."""
    e = mcfg.moe
    return _needs(MOE_ARCH, (("model.moe.dense_layers = 0 (Mixtral routes every layer)", e.dense_layers == 0),
                             ("model.moe.shared_hidden = 0 (no shared expert)", e.shared_hidden == 0),
                             ("model.moe.router = 'softmax'", e.router == "softmax"),
                             ("model.moe.norm_topk = true", e.norm_topk), *_ungrouped(e)))


def qwen3_moe_refusal(mcfg) -> str:
    """Why an MoE config with q/k norms is no Qwen3MoeForCausalLM ("" when it is one)."""
    e = mcfg.moe
    return _needs(QWEN3_MOE_ARCH, (("model.moe.shared_hidden = 0 (no shared expert)", e.shared_hidden == 0),
                                   ("model.moe.router = 'softmax'", e.router == "softmax"), *_ungrouped(e)))


def _ungrouped(e):
    # group-limited routing and a routed scaling are DeepSeek-V3's: Mixtral and Qwen3-MoE have neither
    return (("model.moe.topk_groups = model.moe.n_groups (no group-limited routing)", e.topk_groups == e.n_groups),
            ("model.moe.routed_scaling = 1", e.routed_scaling == 1.0))


def _routed(mcfg, i: int) -> bool:
    return bool(mcfg.moe.num_experts) and i >= mcfg.moe.dense_layers


def names(mcfg) -> dict:
    """hpengine llama name -> (Hugging Face name, transposed), every tensor but the experts' (expert_names)."""
    arch = arch_of(mcfg)
    m = {"wte": ("model.embed_tokens.weight", False), "norm.w": ("model.norm.weight", False)}
    if not mcfg.tie_head:
        m["lm_head.w"] = ("lm_head.weight", True)
    for i in range(mcfg.n_layers):
        p, q = f"h.{i}", f"model.layers.{i}"
        m[f"{p}.attn_norm.w"] = (f"{q}.input_layernorm.weight", False)
        m[f"{p}.mlp_norm.w"] = (f"{q}.post_attention_layernorm.weight", False)
        for a in "qkvo":
            m[f"{p}.attn.{a}.w"] = (f"{q}.self_attn.{a}_proj.weight", True)
        if getattr(mcfg, "qk_norm", False):
            for a in "qk":
                m[f"{p}.attn.{a}_norm.w"] = (f"{q}.self_attn.{a}_norm.weight", False)
        if _routed(mcfg, i):
            m[f"{p}.moe.router.w"] = (f"{q}.{_MOE_BLOCK[arch]}.gate.weight", True)
            continue
        for a in ("gate", "up", "down"):
            m[f"{p}.mlp.{a}.w"] = (f"{q}.mlp.{a}_proj.weight", True)
    return m


def expert_names(mcfg) -> dict:
    """hpengine expert tensor (E, in, out) -> the Hugging Face names of its experts' (out, in) matrices, in order."""
    arch = arch_of(mcfg)
    if arch not in _EXPERT:
        return {}
    block = _MOE_BLOCK[arch]
    return {f"h.{i}.moe.experts.{a}.w": [f"model.layers.{i}.{block}.experts.{e}.{w}.weight"
                                         for e in range(mcfg.moe.num_experts)]
            for i in range(mcfg.n_layers) if _routed(mcfg, i) for a, w in _EXPERT[arch].items()}


def to_hf(P: dict, mcfg) -> dict:
    """hpengine llama parameters -> the state dict of arch_of(mcfg) (numpy; its linears are (out, in))."""
    out = {hf: np.ascontiguousarray(P[n].T if t else P[n]) for n, (hf, t) in names(mcfg).items()}
    for n, hfs in expert_names(mcfg).items():
        out.update({hf: np.ascontiguousarray(P[n][e].T) for e, hf in enumerate(hfs)})
    return out


def hf_config(mcfg, dtype: str, eos: int | None) -> dict:
    """config.json of the arch_of(mcfg) class for model config mcfg."""
    arch, e = arch_of(mcfg), mcfg.moe
    extra = {ARCH: {"model_type": "llama", "mlp_bias": False},
             MOE_ARCH: {"model_type": "mixtral", "intermediate_size": e.expert_hidden or ffn_width(mcfg),
                        "num_local_experts": e.num_experts, "num_experts_per_tok": e.top_k,
                        "router_aux_loss_coef": e.aux_loss, "output_router_logits": False, "router_jitter_noise": 0.0,
                        "sliding_window": None, "mlp_bias": False},
             QWEN3_ARCH: {"model_type": "qwen3", "use_sliding_window": False, "sliding_window": None,
                          "max_window_layers": mcfg.n_layers},
             QWEN3_MOE_ARCH: {"model_type": "qwen3_moe", "moe_intermediate_size": e.expert_hidden or ffn_width(mcfg),
                              "num_experts": e.num_experts, "num_experts_per_tok": e.top_k,
                              "norm_topk_prob": bool(e.norm_topk), "decoder_sparse_step": 1,
                              "mlp_only_layers": list(range(e.dense_layers)), "router_aux_loss_coef": e.aux_loss,
                              "output_router_logits": False, "use_sliding_window": False, "sliding_window": None}}
    return {"architectures": [arch], "hidden_size": mcfg.d_model,
            "intermediate_size": ffn_width(mcfg), "num_hidden_layers": mcfg.n_layers,
            "num_attention_heads": mcfg.n_heads, "num_key_value_heads": mcfg.n_kv_heads or mcfg.n_heads,
            "head_dim": head_width(mcfg), "hidden_act": "silu",
            "max_position_embeddings": mcfg.seq_len, "rope_theta": mcfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": mcfg.rope_theta},
            "rms_norm_eps": mcfg.norm_eps, "attention_bias": False, "attention_dropout": 0.0,
            "initializer_range": mcfg.init_std, **common_config(mcfg, dtype, eos), **extra[arch]}


def _check_arch(arch: str, mcfg, where: str) -> None:
    """Raise HFMismatch when the folder's class is not the one the run's [model] is (arch_of)."""
    ours = arch_of(mcfg)
    if arch == ours:
        return
    qk, experts = arch in (QWEN3_ARCH, QWEN3_MOE_ARCH), arch in (MOE_ARCH, QWEN3_MOE_ARCH)
    if qk != bool(getattr(mcfg, "qk_norm", False)):
        raise HFMismatch(f"{where} is a {arch}, which normalises each head's q and k (q_norm, k_norm), but "
                         "model.qk_norm = false: set model.qk_norm = true" if qk else
                         f"{where} is a {arch}, which has no q/k norms, but model.qk_norm = true: set it false")
    raise HFMismatch(f"{where} is a {arch}, but model.moe.num_experts = 0 (a dense model): set [model.moe] to its "
                     "experts" if experts else
                     f"{where} is a dense {arch}, but model.moe.num_experts = {mcfg.moe.num_experts}")


# Qwen3-MoE's dense layers
# (mlp_only_layers, decoder_sparse_step) are hpengine's first model.moe.dense_layers layers.
def _dense_layers(hc: dict, n_layers: int) -> list[int]:
    """The layers of a Qwen3-MoE config that keep the dense MLP (as Qwen3MoeDecoderLayer decides)."""
    only, step = set(hc.get("mlp_only_layers") or []), hc.get("decoder_sparse_step", 1) or 1
    return [i for i in range(n_layers) if i in only or (i + 1) % step]


def _check_qwen3_moe(hc: dict, mcfg, where: str) -> None:
    e = mcfg.moe
    if qwen3_moe_refusal(mcfg):
        raise HFMismatch(f"{where} is a {QWEN3_MOE_ARCH}, but " + qwen3_moe_refusal(mcfg))
    want("num_experts", hc.get("num_experts", hc.get("num_local_experts")), e.num_experts, "moe.num_experts", where)
    want("num_experts_per_tok", hc.get("num_experts_per_tok"), e.top_k, "moe.top_k", where)
    want("moe_intermediate_size", hc.get("moe_intermediate_size"), e.expert_hidden or ffn_width(mcfg),
         "moe.expert_hidden (each expert's SwiGLU width)", where)
    want("norm_topk_prob", bool(hc.get("norm_topk_prob", False)), bool(e.norm_topk), "moe.norm_topk", where)
    dense = _dense_layers(hc, mcfg.n_layers)
    if dense != list(range(len(dense))):
        raise HFMismatch(f"{where} keeps the dense MLP in layers {dense} (mlp_only_layers "
                         f"{hc.get('mlp_only_layers') or []}, decoder_sparse_step {hc.get('decoder_sparse_step', 1)}); "
                         "hpengine keeps it only in the first model.moe.dense_layers layers")
    want("dense layers (mlp_only_layers, decoder_sparse_step)", len(dense), e.dense_layers, "moe.dense_layers", where)
    if dense:
        want("intermediate_size", hc.get("intermediate_size"), ffn_width(mcfg),
             "ffn_hidden (the dense layers' SwiGLU width)", where)


def _check_head_dim(hc: dict, arch: str, mcfg, where: str) -> None:
    """The folder's head width against the run's (model.head_dim, 0 = d_model / n_heads). Without the key,
    Qwen3Config takes 128, the other classes hidden_size / num_attention_heads (as their attention does)."""
    H, C = hc.get("num_attention_heads") or mcfg.n_heads, hc.get("hidden_size") or mcfg.d_model
    theirs = hc.get("head_dim") or (128 if arch == QWEN3_ARCH else C // H)
    ours = head_width(mcfg)
    if theirs != ours:
        raise HFMismatch(f"{where} has head_dim {theirs} but the run's heads are {ours} wide (model.head_dim = "
                         f"{mcfg.head_dim}, 0 = d_model / n_heads = {mcfg.d_model // mcfg.n_heads}): "
                         f"set model.head_dim = {theirs}")


def check_config(hc: dict, mcfg, where: str) -> bool:
    """Raise HFMismatch when a config.json of one of ARCHS differs from [model]; returns whether it is tied."""
    H = hc.get("num_attention_heads")
    want("hidden_size", hc.get("hidden_size"), mcfg.d_model, "d_model", where)
    want("num_hidden_layers", hc.get("num_hidden_layers"), mcfg.n_layers, "n_layers", where)
    want("num_attention_heads", H, mcfg.n_heads, "n_heads", where)
    want("num_key_value_heads", hc.get("num_key_value_heads") or H, mcfg.n_kv_heads or mcfg.n_heads, "n_kv_heads",
         where)
    arch = (hc.get("architectures") or [ARCH])[0]
    _check_arch(arch, mcfg, where)
    e = mcfg.moe
    if arch == MOE_ARCH:
        if mixtral_refusal(mcfg):
            raise HFMismatch(f"{where} is a {MOE_ARCH}, but " + mixtral_refusal(mcfg))
        want("num_local_experts", hc.get("num_local_experts"), e.num_experts, "moe.num_experts", where)
        want("num_experts_per_tok", hc.get("num_experts_per_tok"), e.top_k, "moe.top_k", where)
        want("intermediate_size", hc.get("intermediate_size"), e.expert_hidden or ffn_width(mcfg),
             "moe.expert_hidden (each expert's SwiGLU width)", where)
    elif arch == QWEN3_MOE_ARCH:
        _check_qwen3_moe(hc, mcfg, where)
    else:
        want("intermediate_size", hc.get("intermediate_size"), ffn_width(mcfg), "ffn_hidden (SwiGLU width)", where)
    if arch in (QWEN3_ARCH, QWEN3_MOE_ARCH) and hc.get("use_sliding_window"):
        raise HFMismatch(f"{where} has use_sliding_window = true; hpengine's llama attends to every earlier position")
    want("vocab_size", hc.get("vocab_size"), mcfg.vocab_size, "vocab_size", where)
    _check_head_dim(hc, arch, mcfg, where)
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
    """A folder's tensors under the names names() and expert_names() use (they already are)."""
    return entries


def from_hf_map(mcfg) -> dict:
    """hpengine llama name -> (Hugging Face name, or the tuple of them a tensor is stacked from; the transform of
    the HF array, or of the list of them)."""
    out = {n: (hf, (lambda a: a.T) if t else (lambda a: a)) for n, (hf, t) in names(mcfg).items()}
    out.update({n: (tuple(hfs), lambda arrs: np.stack([a.T for a in arrs])) for n, hfs in expert_names(mcfg).items()})
    return out
