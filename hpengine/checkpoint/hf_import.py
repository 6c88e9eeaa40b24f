"""`checkpoint.init_from = "hf:DIR"`: start a run from a local Hugging Face model folder.

DIR holds config.json and model.safetensors (or sharded model-*.safetensors with
model.safetensors.index.json) of a GPT2LMHeadModel (-> model.kind = "gpt") or a LlamaForCausalLM
(-> "llama"). The inverse of `hpengine ckpt export --format hf` (hpengine/export.py): GPT-2's c_attn
columns [q|k|v][head][d] are permuted back to hpengine's head-major qkv, Llama's (out, in) linears are
transposed. HFReader serves hpengine-named global tensors through the same read() as
checkpoint.ExportReader, so every layout (tensor-parallel slices, sharded ranges, pipeline stages) loads
it unchanged; each tensor is read lazily (memory-mapped) when a rank asks for it.

Everything that can be checked without reading tensor data is checked when the reader is made, on every
rank alike: the architecture, config.json against the run's [model], every tensor's presence and shape,
and tied against untied output heads.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from hpengine.checkpoint.shards import CheckpointError, read_region
from hpengine.checkpoint.export import HF_KINDS, llama_names
from hpengine.config.load import ffn_width

ARCH_KIND = {arch: kind for kind, arch in HF_KINDS.items()}
PREFIX = "hf:"
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
           "I64": np.int64, "I32": np.int32}


def gpt_qkv_from_hf(a: np.ndarray, n_heads: int) -> np.ndarray:
    """GPT-2's c_attn columns ([q,k,v][h][d]) -> hpengine's head-major fused qkv ([h][q,k,v][d]); the
    inverse of export.gpt_qkv_to_hf, on the last axis (the (C, 3C) weight and the (3C,) bias)."""
    n = a.shape[-1]
    hd = n // (3 * n_heads)
    lead = a.shape[:-1]
    return np.ascontiguousarray(a.reshape(*lead, 3, n_heads, hd).swapaxes(-3, -2).reshape(*lead, n))


class _Safetensors:
    """Lazy, memory-mapped reads of the tensors of one or more .safetensors files (bfloat16 included)."""

    def __init__(self, files: list[Path], where: str):
        self.entries = {}                     # HF name -> (path, dtype code, shape, start byte, end byte)
        for path in files:
            try:
                with open(path, "rb") as f:
                    n = struct.unpack("<Q", f.read(8))[0]
                    header = json.loads(f.read(n))
            except (OSError, ValueError, struct.error) as exc:
                raise CheckpointError(f"{where}: '{path}' is not a readable safetensors file ({exc})") from None
            base = 8 + n
            for name, e in header.items():
                if name != "__metadata__":
                    a, b = e["data_offsets"]
                    self.entries[name] = (path, e["dtype"], tuple(e["shape"]), base + a, base + b)
        self.where = where

    def shape(self, name):
        return self.entries[name][2]

    def get(self, name) -> np.ndarray:
        path, code, shape, a, b = self.entries[name]
        if code not in _DTYPES:
            raise CheckpointError(f"{self.where}: tensor {name} has dtype {code}, which cannot be read "
                                  f"(supported: {', '.join(_DTYPES)})")
        dt = np.dtype(_DTYPES[code]).newbyteorder("<")
        count = (b - a) // dt.itemsize
        raw = np.memmap(path, dtype=dt, mode="r", offset=a, shape=(count,)) if count else np.zeros(0, dt)
        if code == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        return np.asarray(raw, dtype=np.float64).reshape(shape)


def _files(folder: Path, where: str) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{where}: '{index}' is unreadable or has no weight_map ({exc})") from None
        files = [folder / f for f in sorted(set(wm.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{where}: shard '{f}' named in {index.name} is missing")
        return files
    raise CheckpointError(f"{where}: no model.safetensors or model.safetensors.index.json in '{folder}' "
                          "(only safetensors weights can be read)")


def _want(key: str, theirs, ours, ours_key: str, where: str) -> None:
    if theirs != ours:
        raise CheckpointError(f"{where} has {key} {theirs} but model.{ours_key} = {ours}")


def _check_config(hc: dict, mcfg, where: str) -> str:
    """The model kind of config.json; raises when its shape differs from the run's [model]."""
    arch = (hc.get("architectures") or [None])[0]
    kind = ARCH_KIND.get(arch)
    if kind is None:
        raise CheckpointError(f"{where}: architecture {arch!r} is not supported; supported: "
                              + ", ".join(f"{a} (model.kind = {k!r})" for a, k in ARCH_KIND.items()))
    if mcfg.kind != kind:
        raise CheckpointError(f"{where} is a {arch} (model.kind = {kind!r}) but model.kind = {mcfg.kind!r}")
    if kind == "gpt":
        C = hc.get("n_embd", 768)
        _want("n_embd", C, mcfg.d_model, "d_model", where)
        _want("n_layer", hc.get("n_layer", 12), mcfg.n_layers, "n_layers", where)
        _want("n_head", hc.get("n_head", 12), mcfg.n_heads, "n_heads", where)
        _want("n_inner", hc.get("n_inner") or 4 * C, mcfg.ffn_mult * mcfg.d_model, "ffn_mult * d_model", where)
        _want("vocab_size", hc.get("vocab_size", 50257), mcfg.vocab_size, "vocab_size", where)
        npos = hc.get("n_positions", 1024)
        if npos < mcfg.seq_len:
            raise CheckpointError(f"{where} has n_positions {npos} but model.seq_len = {mcfg.seq_len} "
                                  "(at most n_positions)")
        act = hc.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"{where} has activation_function {act!r}; hpengine's gpt uses 'gelu_new'")
        eps = hc.get("layer_norm_epsilon", 1e-5)
        if eps != 1e-5:
            raise CheckpointError(f"{where} has layer_norm_epsilon {eps}; hpengine's gpt LayerNorm uses 1e-05")
        tied = hc.get("tie_word_embeddings", True)
    else:
        H = hc.get("num_attention_heads")
        _want("hidden_size", hc.get("hidden_size"), mcfg.d_model, "d_model", where)
        _want("num_hidden_layers", hc.get("num_hidden_layers"), mcfg.n_layers, "n_layers", where)
        _want("num_attention_heads", H, mcfg.n_heads, "n_heads", where)
        _want("num_key_value_heads", hc.get("num_key_value_heads") or H, mcfg.n_kv_heads or mcfg.n_heads,
              "n_kv_heads", where)
        _want("intermediate_size", hc.get("intermediate_size"), ffn_width(mcfg), "ffn_hidden (SwiGLU width)",
              where)
        _want("vocab_size", hc.get("vocab_size"), mcfg.vocab_size, "vocab_size", where)
        if hc.get("head_dim") is not None:
            _want("head_dim", hc["head_dim"], mcfg.d_model // mcfg.n_heads, "d_model / model.n_heads", where)
        rope = hc.get("rope_parameters") or hc.get("rope_scaling") or {}
        theta = hc.get("rope_theta", rope.get("rope_theta", 10000.0))
        _want("rope_theta", float(theta), float(mcfg.rope_theta), "rope_theta", where)
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CheckpointError(f"{where} has rope_type {rope.get('rope_type', rope.get('type'))!r}; "
                                  "hpengine's llama supports only the default rotary embedding")
        _want("rms_norm_eps", hc.get("rms_norm_eps", 1e-6), mcfg.norm_eps, "norm_eps", where)
        for flag in ("attention_bias", "mlp_bias"):
            if hc.get(flag):
                raise CheckpointError(f"{where} has {flag} = true; hpengine's llama has no biases")
        act = hc.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{where} has hidden_act {act!r}; hpengine's llama uses 'silu'")
        tied = hc.get("tie_word_embeddings", False)
    if bool(tied) != bool(mcfg.tie_head):
        raise CheckpointError(
            f"{where} has tied embeddings (tie_word_embeddings = true) but model.tie_head = false"
            if tied else
            f"{where} has an untied output head (tie_word_embeddings = false) but model.tie_head = true")
    return kind


def _gpt_map(mcfg) -> dict:
    """hpengine gpt name -> (Hugging Face name, transform of the HF array)."""
    H = mcfg.n_heads
    same = lambda a: a                                      # noqa: E731
    m = {"wte": ("transformer.wte.weight", same), "wpe": ("transformer.wpe.weight", lambda a: a[:mcfg.seq_len]),
         "ln_f.w": ("transformer.ln_f.weight", same), "ln_f.b": ("transformer.ln_f.bias", same)}
    if not mcfg.tie_head:
        m["lm_head.w"] = ("lm_head.weight", lambda a: a.T)
    qkv = lambda a: gpt_qkv_from_hf(a, H)                   # noqa: E731
    for i in range(mcfg.n_layers):
        p, q = f"h.{i}", f"transformer.h.{i}"
        m[f"{p}.attn.qkv.w"] = (f"{q}.attn.c_attn.weight", qkv)
        m[f"{p}.attn.qkv.b"] = (f"{q}.attn.c_attn.bias", qkv)
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2"), ("attn.proj", "attn.c_proj"),
                             ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            m[f"{p}.{ours}.w"] = (f"{q}.{theirs}.weight", same)
            m[f"{p}.{ours}.b"] = (f"{q}.{theirs}.bias", same)
    return m


def _llama_map(mcfg) -> dict:
    return {n: (hf, (lambda a: a.T) if t else (lambda a: a))
            for n, (hf, t) in llama_names(mcfg.n_layers, mcfg.tie_head).items()}


class HFReader:
    """checkpoint.ExportReader's read() over a Hugging Face model folder, for checkpoint.init_from = "hf:DIR".
    `shapes` are the run's true (unpadded) global shapes by hpengine name (engine.true_shapes())."""

    step = 0

    def __init__(self, folder, mcfg, shapes: dict):
        self.dir = Path(folder)
        self.where = where = f"checkpoint.init_from = 'hf:{folder}'"
        cpath = self.dir / "config.json"
        try:
            hc = json.loads(cpath.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{where}: '{cpath}' is missing or not JSON ({exc})") from None
        kind = _check_config(hc, mcfg, f"hf:{folder}")
        self.st = _Safetensors(_files(self.dir, where), where)
        if kind == "gpt" and "transformer.wte.weight" not in self.st.entries and "wte.weight" in self.st.entries:
            self.st.entries = {f"transformer.{k}": v for k, v in self.st.entries.items()}   # bare GPT2Model names
        self.map = _gpt_map(mcfg) if kind == "gpt" else _llama_map(mcfg)
        extra = sorted(set(shapes) - set(self.map))
        if extra:
            raise CheckpointError(f"{where}: the run has tensors {extra[:4]} with no Hugging Face counterpart")
        for name, (hf, fn) in self.map.items():
            if hf not in self.st.entries:
                raise CheckpointError(f"{where}: tensor {hf} (hpengine {name}) is missing")
            got = tuple(fn(np.empty(self.st.shape(hf), dtype=np.uint8)).shape)
            want = tuple(shapes.get(name, got))
            if got != want:
                raise CheckpointError(f"{where}: tensor {hf} has shape {list(self.st.shape(hf))}, which gives "
                                      f"{name} {list(got)} but the run's {name} is {list(want)}")

    def read(self, kind, name, region):
        """float64 values of global region of hpengine parameter `name`; beyond its true shape, 0."""
        if kind != "param" or name not in self.map:
            raise CheckpointError(f"{self.where} has no {kind} {name!r}")
        hf, fn = self.map[name]
        return read_region(fn(self.st.get(hf)), region)

    def close(self):
        self.st = None
