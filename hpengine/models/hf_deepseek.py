"""The deepseek kind's Hugging Face adapter, both directions: DeepseekV3ForCausalLM's config.json to and from hpengine
[model] keys (flat {"model.mla.kv_lora_rank": 512, ...} dicts; every function also takes a [model] config), the
weight-name map both ways with DeepSeek's multi-token prediction layers, and the router's selection biases.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hpengine.config.load import ffn_width
from hpengine.models.hf_common import HFMismatch, common_config

ARCH = "DeepseekV3ForCausalLM"
# config.json model_type: Kimi K2 publishes "kimi_k2" with DeepseekV3ForCausalLM's fields (transformers reads it as
# deepseek_v3, as its Kimi K2.5 config does for its text model)
MODEL_TYPES = (None, "deepseek_v3", "kimi_k2")
MLA = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")   # same names both sides
YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# hpengine [model] key <- config.json field, where one is the other unchanged
SAME = {"model.d_model": "hidden_size", "model.n_layers": "num_hidden_layers", "model.n_heads": "num_attention_heads",
        "model.ffn_hidden": "intermediate_size", "model.norm_eps": "rms_norm_eps", "model.vocab_size": "vocab_size",
        "model.init_std": "initializer_range"}
MOE = {"model.moe.num_experts": "n_routed_experts", "model.moe.top_k": "num_experts_per_tok",
       "model.moe.expert_hidden": "moe_intermediate_size", "model.moe.dense_layers": "first_k_dense_replace",
       "model.moe.norm_topk": "norm_topk_prob", "model.moe.n_groups": "n_group", "model.moe.topk_groups": "topk_group",
       "model.moe.routed_scaling": "routed_scaling_factor"}
# fields of DeepSeek's published config.json that transformers ignores, and the only values hpengine runs
PUBLISHED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def _refuse(hc: dict, where: str) -> None:
    """Raise HFMismatch for what a DeepSeek-V3 config.json may say that hpengine's deepseek kind does not run."""
    checks = [("hidden_act", hc.get("hidden_act", "silu"), "silu"),
              ("attention_bias", hc.get("attention_bias", False), False),
              ("rope_interleave", hc.get("rope_interleave", True), True),
              ("num_key_value_heads", hc.get("num_key_value_heads") or hc.get("num_attention_heads"),
               hc.get("num_attention_heads"))]
    checks += [(k, hc[k], v) for k, v in PUBLISHED.items() if k in hc]
    for key, theirs, ours in checks:
        if theirs != ours:
            raise HFMismatch(f"{where} has {key} {theirs!r}; hpengine's deepseek kind runs only {ours!r}")


def _rope(hc: dict, where: str) -> dict:
    """The rope keys of a config.json: rope_theta, and model.rope_scaling.* for YaRN (none for the default rope)."""
    rope = hc.get("rope_parameters") or hc.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {"model.rope_theta": float(rope.get("rope_theta", hc.get("rope_theta", 10000.0)))}
    if kind == "default":
        return out
    if kind != "yarn":
        raise HFMismatch(f"{where} has rope_type {kind!r}; the deepseek kind runs 'default' or 'yarn'")
    for key, ok in (("attention_factor", None), ("truncate", True), ("partial_rotary_factor", 1.0)):
        if rope.get(key, ok) != ok:
            raise HFMismatch(f"{where} has rope_parameters.{key} {rope[key]!r}; hpengine's YaRN needs it unset "
                             f"({ok!r}): the attention factor follows from factor, mscale and mscale_all_dim")
    if rope.get("original_max_position_embeddings") is None:
        raise HFMismatch(f"{where} has YaRN without original_max_position_embeddings; it needs the pretraining length")
    factor = rope.get("factor") or hc["max_position_embeddings"] / rope["original_max_position_embeddings"]
    # transformers reads a missing or null beta_fast / beta_slow as 32 / 1, a missing mscale as unset (hpengine's 0)
    yarn = {"factor": float(factor), "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope.get("beta_fast") or 32), "beta_slow": float(rope.get("beta_slow") or 1),
            "mscale": float(rope.get("mscale") or 0.0), "mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0)}
    return {**out, "model.rope_scaling.type": "yarn", **{f"model.rope_scaling.{k}": v for k, v in yarn.items()}}


def keys_from_hf(hc: dict, where: str) -> dict:
    """hpengine [model] keys ("model.mla.kv_lora_rank" -> 512, ...) of a DeepseekV3ForCausalLM config.json; raises
    HFMismatch for what the kind does not run. Not in config.json, so not set: seq_len, dtype, model.mtp.loss_weight,
    model.moe.bias_update_rate (DeepSeek-V3 trained with 0.001), aux_loss."""
    _refuse(hc, where)
    keys = {"model.kind": "deepseek", **{k: hc[v] for k, v in SAME.items()},
            "model.tie_head": bool(hc.get("tie_word_embeddings", False)), **_rope(hc, where),
            **{f"model.mla.{k}": hc.get(k) or 0 for k in MLA},
            "model.mtp.depth": hc.get("num_nextn_predict_layers") or 0}
    dense = hc.get("first_k_dense_replace") or 0
    if not hc.get("n_routed_experts") or dense >= hc["num_hidden_layers"]:
        return {**keys, "model.moe.num_experts": 0}
    keys.update({k: hc.get(v) for k, v in MOE.items()})
    keys.update({"model.moe.dense_layers": dense, "model.moe.router": "sigmoid",
                 "model.moe.norm_topk": bool(hc.get("norm_topk_prob")),
                 "model.moe.n_groups": hc.get("n_group") or 1, "model.moe.topk_groups": hc.get("topk_group") or 1,
                 "model.moe.routed_scaling": float(hc.get("routed_scaling_factor", 1.0)),
                 "model.moe.shared_hidden": (hc.get("n_shared_experts") or 0) * hc["moe_intermediate_size"]})
    return keys


def keys_of(mcfg) -> dict:
    """The [model] keys of a deepseek [model] config, as keys_from_hf gives them (and model.seq_len); widths left to
    their rules (ffn_hidden 0, expert_hidden 0) are the widths the model builds."""
    a, r, e, F = mcfg.mla, mcfg.rope_scaling, mcfg.moe, ffn_width(mcfg)
    keys = {"model.kind": "deepseek", "model.d_model": mcfg.d_model, "model.n_layers": mcfg.n_layers,
            "model.n_heads": mcfg.n_heads, "model.ffn_hidden": F, "model.norm_eps": mcfg.norm_eps,
            "model.vocab_size": mcfg.vocab_size, "model.init_std": mcfg.init_std, "model.tie_head": bool(mcfg.tie_head),
            "model.rope_theta": float(mcfg.rope_theta), **{f"model.mla.{m}": getattr(a, m) for m in MLA},
            "model.mtp.depth": mcfg.mtp.depth, "model.seq_len": mcfg.seq_len}
    if r.type == "yarn":
        keys.update({"model.rope_scaling.type": "yarn", **{f"model.rope_scaling.{y}": getattr(r, y) for y in YARN}})
    if not e.num_experts:
        return {**keys, "model.moe.num_experts": 0}
    return {**keys, "model.moe.num_experts": e.num_experts, "model.moe.top_k": e.top_k,
            "model.moe.expert_hidden": e.expert_hidden or F, "model.moe.dense_layers": e.dense_layers,
            "model.moe.router": e.router, "model.moe.norm_topk": bool(e.norm_topk), "model.moe.n_groups": e.n_groups,
            "model.moe.topk_groups": e.topk_groups, "model.moe.routed_scaling": float(e.routed_scaling),
            "model.moe.shared_hidden": e.shared_hidden}


def _keys(cfg) -> dict:
    """[model] keys of `cfg`: a flat key dict as it is, or a [model] config (keys_of)."""
    return cfg if isinstance(cfg, dict) else keys_of(cfg)


# config.json's field of each [model] key check_config compares (its value in hpengine's terms)
FIELDS = {**{k: v for k, v in SAME.items()}, **MOE, **{f"model.mla.{m}": m for m in MLA},
          **{f"model.rope_scaling.{y}": f"rope_parameters.{y}" for y in YARN},
          "model.rope_theta": "rope_theta", "model.rope_scaling.type": "rope_parameters.rope_type",
          "model.mtp.depth": "num_nextn_predict_layers", "model.moe.router": "scoring_func",
          "model.moe.shared_hidden": "n_shared_experts x moe_intermediate_size"}
# not compared: the initial std (no part of a trained model), ties (the importer's own check), seq_len (not held)
UNCOMPARED = ("model.init_std", "model.tie_head", "model.seq_len", "model.kind")


def check_config(hc: dict, mcfg, where: str) -> bool:
    """Raise HFMismatch, in one line naming the field and the key, at the first config.json field that differs from
    the run's [model]; returns whether the folder's head is tied. A folder's MTP layers are skipped (as transformers
    skips them) when model.mtp.depth = 0."""
    if hc.get("model_type") not in MODEL_TYPES:
        raise HFMismatch(f"{where} has model_type {hc.get('model_type')!r}; a {ARCH} folder is "
                         "'deepseek_v3' (or Kimi K2's 'kimi_k2')")
    theirs, ours = keys_from_hf(hc, where), keys_of(mcfg)
    skip = set(UNCOMPARED)
    if ours["model.mtp.depth"] == 0:
        skip.add("model.mtp.depth")
    if ours["model.moe.num_experts"] and not ours["model.moe.dense_layers"]:
        skip.add("model.ffn_hidden")                # no dense layer: the dense width is used nowhere
    for d in (theirs, ours):
        d.setdefault("model.rope_scaling.type", "none")
    for key in [*theirs, *(k for k in ours if k not in theirs)]:
        if key not in skip and theirs.get(key) != ours.get(key):
            raise HFMismatch(f"{where} has {FIELDS.get(key, key)} = {theirs.get(key)!r} but {key} = {ours.get(key)!r}")
    return bool(hc.get("tie_word_embeddings", False))


def export_refusal(cfg) -> str:
    """Why these keys (or this [model] config) have no DeepseekV3ForCausalLM ("" when they have one)."""
    keys = _keys(cfg)
    e = keys.get("model.moe.num_experts", 0)
    if e and keys.get("model.moe.router", "sigmoid") != "sigmoid":
        return "a DeepseekV3ForCausalLM routes by a sigmoid per expert: needs model.moe.router = 'sigmoid'"
    if e and keys.get("model.moe.shared_hidden", 0) % keys["model.moe.expert_hidden"]:
        return ("a DeepseekV3ForCausalLM's shared experts are n_shared_experts x moe_intermediate_size wide: needs "
                "model.moe.shared_hidden a multiple of model.moe.expert_hidden")
    return ""


def hf_config(cfg, dtype: str, eos: int | None) -> dict:
    """config.json of the DeepseekV3ForCausalLM that [model] keys (or a [model] config) describe (keys_from_hf's
    inverse; seq_len -> max_position_embeddings)."""
    k = _keys(cfg)
    hc = {"architectures": [ARCH], "model_type": "deepseek_v3", **{v: k[n] for n, v in SAME.items()},
          "num_key_value_heads": k["model.n_heads"], "hidden_act": "silu", "attention_bias": False,
          "attention_dropout": 0.0, "rope_interleave": True, "max_position_embeddings": k["model.seq_len"],
          **{m: k[f"model.mla.{m}"] or (None if m == "q_lora_rank" else 0) for m in MLA},
          "num_nextn_predict_layers": k.get("model.mtp.depth", 0),
          **common_config(SimpleNamespace(vocab_size=k["model.vocab_size"], tie_head=k["model.tie_head"]), dtype, eos)}
    rope = {"rope_type": "default", "rope_theta": k["model.rope_theta"]}
    if k.get("model.rope_scaling.type", "none") == "yarn":
        rope = {**rope, "rope_type": "yarn", **{y: k[f"model.rope_scaling.{y}"] for y in YARN}}
    hc.update(rope_theta=k["model.rope_theta"], rope_parameters=rope)
    if not k.get("model.moe.num_experts"):       # every layer dense
        return {**hc, "first_k_dense_replace": k["model.n_layers"], "n_routed_experts": 0, "n_shared_experts": 0}
    hc.update({v: k[n] for n, v in MOE.items()})
    hc["n_shared_experts"] = k.get("model.moe.shared_hidden", 0) // k["model.moe.expert_hidden"]
    return hc


def _routed(keys: dict, i: int) -> bool:
    return bool(keys.get("model.moe.num_experts")) and i >= keys.get("model.moe.dense_layers", 0)


def _block(p: str, q: str, keys: dict, routed: bool) -> tuple[dict, dict]:
    """One decoder block's tensors: ({hpengine name: (HF name, transposed)}, {stacked expert tensor: [HF names]})
    for hpengine prefix p ("h.3") and HF prefix q ("model.layers.3"). hpengine's matrices are (in, out), HF's (out, in);
    kv_a's output is [latent (kv_lora_rank), rope key (qk_rope_head_dim)] on both sides (kv_a_proj_with_mqa)."""
    a, att = f"{p}.attn", f"{q}.self_attn"
    m = {f"{p}.attn_norm.w": (f"{q}.input_layernorm.weight", False),
         f"{p}.mlp_norm.w": (f"{q}.post_attention_layernorm.weight", False),
         f"{a}.kv_a.w": (f"{att}.kv_a_proj_with_mqa.weight", True),
         f"{a}.kv_a_norm.w": (f"{att}.kv_a_layernorm.weight", False),
         f"{a}.kv_b.w": (f"{att}.kv_b_proj.weight", True), f"{a}.o.w": (f"{att}.o_proj.weight", True)}
    if keys.get("model.mla.q_lora_rank"):
        m.update({f"{a}.q_a.w": (f"{att}.q_a_proj.weight", True),
                  f"{a}.q_a_norm.w": (f"{att}.q_a_layernorm.weight", False),
                  f"{a}.q_b.w": (f"{att}.q_b_proj.weight", True)})
    else:
        m[f"{a}.q.w"] = (f"{att}.q_proj.weight", True)
    if not routed:
        m.update({f"{p}.mlp.{w}.w": (f"{q}.mlp.{w}_proj.weight", True) for w in ("gate", "up", "down")})
        return m, {}
    m[f"{p}.moe.router.w"] = (f"{q}.mlp.gate.weight", True)
    if keys.get("model.moe.shared_hidden"):
        m.update({f"{p}.moe.shared.{w}.w": (f"{q}.mlp.shared_experts.{w}_proj.weight", True)
                  for w in ("gate", "up", "down")})
    E = keys["model.moe.num_experts"]
    experts = {f"{p}.moe.experts.{w}.w": [f"{q}.mlp.experts.{e}.{w}_proj.weight" for e in range(E)]
               for w in ("gate", "up", "down")}
    return m, experts


def names(keys: dict) -> dict:
    """hpengine name -> (Hugging Face name, transposed), every tensor but the stacked experts' and MTP's."""
    m = {"wte": ("model.embed_tokens.weight", False), "norm.w": ("model.norm.weight", False)}
    if not keys.get("model.tie_head"):
        m["lm_head.w"] = ("lm_head.weight", True)
    for i in range(keys["model.n_layers"]):
        m.update(_block(f"h.{i}", f"model.layers.{i}", keys, _routed(keys, i))[0])
    return m


def expert_names(keys: dict) -> dict:
    """hpengine expert tensor (E, in, out) -> the Hugging Face names of its experts' (out, in) matrices, in order."""
    return {n: hfs for i in range(keys["model.n_layers"])
            for n, hfs in _block(f"h.{i}", f"model.layers.{i}", keys, _routed(keys, i))[1].items()}


# Multi-token prediction (models/mtp.py): DeepSeek's published files hold MTP module k as decoder layer n_layers + k
# (transformers builds none and ignores them), with enorm (the next token's embedding), hnorm (the previous depth's
# hidden state), eh_proj (2C -> C, its input [enorm(embedding), hnorm(hidden)]), shared_head.norm (the final norm
# before the shared output head) and one decoder block, hpengine's mtp.{k}.<block names> (routed in an MoE model,
# as hpengine builds it); embed_tokens and shared_head.head are copies of the main model's embedding and output head.
def mtp_names(keys: dict) -> tuple[dict, dict]:
    """({hpengine MTP name: (HF name, transposed)}, {stacked expert tensor: [HF names]}) of the model.mtp.depth
    modules."""
    m, experts, L = {}, {}, keys["model.n_layers"]
    for k in range(keys.get("model.mtp.depth", 0)):
        p, q = f"mtp.{k}", f"model.layers.{L + k}"
        m.update({f"{p}.enorm.w": (f"{q}.enorm.weight", False), f"{p}.hnorm.w": (f"{q}.hnorm.weight", False),
                  f"{p}.eh_proj.w": (f"{q}.eh_proj.weight", True),
                  f"{p}.norm.w": (f"{q}.shared_head.norm.weight", False)})
        block, ex = _block(p, q, keys, bool(keys.get("model.moe.num_experts")))
        m.update(block)
        experts.update(ex)
    return m, experts


def mtp_copies(keys: dict) -> dict:
    """HF name -> (the hpengine tensor it copies, transposed): each MTP layer's embed_tokens and shared_head.head."""
    L, out = keys["model.n_layers"], {}
    for k in range(keys.get("model.mtp.depth", 0)):
        out[f"model.layers.{L + k}.embed_tokens.weight"] = ("wte", False)
        out[f"model.layers.{L + k}.shared_head.head.weight"] = ("wte", False) if keys.get("model.tie_head") else \
            ("lm_head.w", True)
    return out


def bias_names(keys: dict) -> dict:
    """Row of the router-bias state (models/moe_bias.py: (n_layers, E), one row per layer; "mtp.{k}" for an MTP
    block, which routes without a selection bias) -> the HF name of that layer's e_score_correction_bias (E,)."""
    L = keys["model.n_layers"]
    out = {i: f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(L) if _routed(keys, i)}
    out.update({f"mtp.{k}": f"model.layers.{L + k}.mlp.gate.e_score_correction_bias"
                for k in range(keys.get("model.mtp.depth", 0)) if keys.get("model.moe.num_experts")})
    return out


def _all(keys: dict) -> tuple[dict, dict]:
    mtp, mtp_experts = mtp_names(keys)
    return {**names(keys), **mtp}, {**expert_names(keys), **mtp_experts}


def bias_to_hf(bias, cfg) -> dict:
    """The e_score_correction_bias tensors (float64, hpengine's state exactly) of router biases `bias`: the
    (n_layers, E) state (models/moe_bias.saved_bias) or {bias_names row: (E,)}; zeros where absent (None: none at
    all), and always for an MTP block, which routes without one."""
    keys = _keys(cfg)
    E, out = keys.get("model.moe.num_experts", 0), {}
    for row, hf in bias_names(keys).items():
        b = None if bias is None or isinstance(row, str) else bias.get(row) if isinstance(bias, dict) else bias[row]
        out[hf] = np.array(np.zeros(E) if b is None else b, dtype=np.float64)
    return out


def bias_from_hf(get, cfg, where: str):
    """The router-bias state, (n_layers, E) float64 (rows of dense layers zero), of a folder whose tensors `get`
    reads by HF name (float64); None for a dense model. Raises HFMismatch for a bias of another shape, and for a
    nonzero bias of an MTP layer the run builds (hpengine's MTP blocks route without one)."""
    keys = _keys(cfg)
    L, E = keys["model.n_layers"], keys.get("model.moe.num_experts", 0)
    if not E:
        return None
    out = np.zeros((L, E))
    for row, hf in bias_names(keys).items():
        b = get(hf)
        if b.shape != (E,):
            raise HFMismatch(f"{where}: tensor {hf} has shape {list(b.shape)}; the router bias of "
                             f"model.moe.num_experts = {E} experts is [{E}]")
        if isinstance(row, str) and b.any():
            raise HFMismatch(f"{where}: tensor {hf} (MTP module {row[4:]}'s router bias) is nonzero, but hpengine's "
                             "multi-token prediction blocks route without a selection bias: set model.mtp.depth = 0 "
                             "to start without the MTP modules")
        if not isinstance(row, str):
            out[row] = b
    return out


def to_hf(P: dict, cfg, bias=None) -> dict:
    """hpengine parameters (and router biases, as bias_to_hf takes them) -> the state dict of the
    DeepseekV3ForCausalLM, DeepSeek's MTP layers included (numpy; its linears are (out, in))."""
    keys = _keys(cfg)
    plain, experts = _all(keys)
    out = {hf: np.ascontiguousarray(P[n].T if t else P[n]) for n, (hf, t) in plain.items()}
    for n, hfs in experts.items():
        out.update({hf: np.ascontiguousarray(P[n][e].T) for e, hf in enumerate(hfs)})
    out.update({hf: np.ascontiguousarray(P[n].T if t else P[n]) for hf, (n, t) in mtp_copies(keys).items()})
    return {**out, **bias_to_hf(bias, keys)}


def full_names(entries: dict) -> dict:
    """A folder's tensors under the names names() uses (they already are)."""
    return entries


def _transform(t: bool):
    return (lambda a: a.T) if t else (lambda a: a)


def from_hf_map(cfg) -> dict:
    """hpengine name -> (Hugging Face name, or the tuple of them a tensor is stacked from; the transform of the HF
    array, or of the list of them). The router biases are state, not parameters: bias_from_hf."""
    plain, experts = _all(_keys(cfg))
    out = {n: (hf, _transform(t)) for n, (hf, t) in plain.items()}
    out.update({n: (tuple(hfs), lambda arrs: np.stack([a.T for a in arrs])) for n, hfs in experts.items()})
    return out


def copies(cfg) -> dict:
    """hpengine name -> [(HF name, transform)] of the folder's tensors that must equal it (each MTP layer's
    embed_tokens and shared_head.head: wte and the output head)."""
    out = {}
    for hf, (n, t) in mtp_copies(_keys(cfg)).items():
        out.setdefault(n, []).append((hf, _transform(t)))
    return out
