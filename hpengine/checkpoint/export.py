"""`hpengine ckpt export`: a checkpoint folder as one file for other tools.

    hdf5          one HDF5 file of global tensors, parameters and (unless params_only) Adam moments: what
                  checkpoint.init_from reads (checkpoint.export)
    safetensors   one .safetensors file of the parameters under hpengine's names, global true-shape
                  tensors in the checkpoint's dtype; metadata {"format": "hpengine", "config": TOML, "step"}
    hf            a Hugging Face transformers model folder: config.json, generation_config.json,
                  model.safetensors and, when the run used a Hugging Face tokenizer, its tokenizer files.
                  gpt -> GPT2LMHeadModel, llama -> LlamaForCausalLM.

Global tensors are read at their true shape (the manifest's `shapes`), so tensor-parallel vocabulary
padding never reaches an export. Every format is written under a temporary name and renamed at the end;
an existing OUT is refused unless force.

GPT-2's Conv1D stores weights (in, out), as hpengine does, so no GPT tensor is transposed — but hpengine's
fused qkv is head-major (column h*3*hd + j*hd + d is head h, part j in q, k, v, element d) while GPT-2's
c_attn is [all q | all k | all v] (column j*C + h*hd + d): the columns and the bias are permuted. Llama's
HF linears are (out, in): every 2-D tensor but the embedding is transposed (README, "Model kinds").
"""
from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

import numpy as np

from hpengine.checkpoint.shards import CheckpointError, Reader, export as export_hdf5
from hpengine.config.load import from_dict
from hpengine.config.load import ffn_width
from hpengine.data.format import sha256_text
from hpengine.data.format import TokenFile
from hpengine.data.tokenizer import EOS_CANDIDATES

FORMATS = ("hdf5", "safetensors", "hf")
HF_KINDS = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


def _safetensors():
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise CheckpointError("export --format safetensors|hf needs the 'safetensors' package "
                              "(pip install safetensors)") from None
    return save_file


def _model_config(toml_text: str):
    return from_dict(tomllib.loads(toml_text))


def select_model(P: dict, cfg, index: int | None) -> dict:
    """One model's parameters under its own names: a train.models = K checkpoint stores model i's tensors
    as "m{i}." + name. index None is model 0 of a one-model checkpoint; with K > 1 it must be given."""
    k = cfg.train.models
    if index is None and k > 1:
        raise CheckpointError(f"the checkpoint holds {k} models (train.models = {k}): pass --model I, "
                              f"I in 0..{k - 1}")
    index = index or 0
    if not 0 <= index < k:
        raise CheckpointError(f"--model {index}: the checkpoint holds {k} model(s); valid: 0..{k - 1}")
    if k == 1:
        return P
    pre = f"m{index}."
    return {n[len(pre):]: a for n, a in P.items() if n.startswith(pre)}


def read_params(path) -> tuple[Reader, dict]:
    """The checkpoint's parameters as global true-shape arrays in their stored dtype, by hpengine name."""
    r = Reader(path)
    params = {}
    try:
        for name, shape in r.manifest["shapes"].items():
            pieces = r.by_tensor.get(("param", name))
            if not pieces:
                raise CheckpointError(f"checkpoint '{r.dir}' has no parameter values for {name!r}")
            params[name] = r.read("param", name, tuple(slice(0, n) for n in shape)).astype(pieces[0]["dtype"])
    finally:
        r.close()
    return r, params


# --- name maps ---------------------------------------------------------------------------------
def gpt_qkv_to_hf(a: np.ndarray, n_heads: int) -> np.ndarray:
    """hpengine's head-major fused qkv (columns [h][q,k,v][d]) -> GPT-2's c_attn ([q,k,v][h][d]); the last
    axis is permuted, so this serves the (C, 3C) weight and the (3C,) bias."""
    n = a.shape[-1]
    hd = n // (3 * n_heads)
    lead = a.shape[:-1]
    return np.ascontiguousarray(a.reshape(*lead, n_heads, 3, hd).swapaxes(-3, -2).reshape(*lead, n))


def gpt_to_hf(P: dict, mcfg) -> dict:
    """hpengine gpt parameters -> GPT2LMHeadModel's state dict (numpy)."""
    H = mcfg.n_heads
    out = {"transformer.wte.weight": P["wte"], "transformer.wpe.weight": P["wpe"],
           "transformer.ln_f.weight": P["ln_f.w"], "transformer.ln_f.bias": P["ln_f.b"]}
    if not mcfg.tie_head:
        out["lm_head.weight"] = P["lm_head.w"].T
    for i in range(mcfg.n_layers):
        p, q = f"h.{i}", f"transformer.h.{i}"
        out[f"{q}.attn.c_attn.weight"] = gpt_qkv_to_hf(P[f"{p}.attn.qkv.w"], H)
        out[f"{q}.attn.c_attn.bias"] = gpt_qkv_to_hf(P[f"{p}.attn.qkv.b"], H)
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"{q}.{theirs}.weight"], out[f"{q}.{theirs}.bias"] = P[f"{p}.{ours}.w"], P[f"{p}.{ours}.b"]
        for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[f"{q}.{theirs}.weight"], out[f"{q}.{theirs}.bias"] = P[f"{p}.{ours}.w"], P[f"{p}.{ours}.b"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def llama_names(n_layers: int, tied: bool) -> dict:
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


def llama_to_hf(P: dict, mcfg) -> dict:
    return {hf: np.ascontiguousarray(P[n].T if t else P[n])
            for n, (hf, t) in llama_names(mcfg.n_layers, mcfg.tie_head).items()}


def hf_config(mcfg, dtype: str, eos: int | None) -> dict:
    """config.json of the Hugging Face model for model config mcfg."""
    ids = {"bos_token_id": eos, "eos_token_id": eos}     # hpengine's end-of-document token starts the next one
    common = {"vocab_size": mcfg.vocab_size, "tie_word_embeddings": bool(mcfg.tie_head), "torch_dtype": dtype,
              "use_cache": True, **ids}
    if mcfg.kind == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": mcfg.d_model,
                "n_layer": mcfg.n_layers, "n_head": mcfg.n_heads, "n_inner": mcfg.ffn_mult * mcfg.d_model,
                "n_positions": mcfg.seq_len, "n_ctx": mcfg.seq_len, "layer_norm_epsilon": 1e-5,
                "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "summary_first_dropout": 0.0, "scale_attn_weights": True, "reorder_and_upcast_attn": False,
                "scale_attn_by_inverse_layer_idx": False, **common}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": mcfg.d_model,
            "intermediate_size": ffn_width(mcfg), "num_hidden_layers": mcfg.n_layers,
            "num_attention_heads": mcfg.n_heads, "num_key_value_heads": mcfg.n_kv_heads or mcfg.n_heads,
            "head_dim": mcfg.d_model // mcfg.n_heads, "hidden_act": "silu",
            "max_position_embeddings": mcfg.seq_len, "rope_theta": mcfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": mcfg.rope_theta},
            "rms_norm_eps": mcfg.norm_eps, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "initializer_range": mcfg.init_std, **common}


# --- tokenizer ---------------------------------------------------------------------------------
def run_tokenizer(r: Reader, cfg) -> tuple[str | None, str]:
    """(tokenizer.json text of the run, where) — the run folder is the checkpoint's <run>/checkpoints/step_N
    grandparent, else train.out_dir of the saved config; the text must match the checkpoint's recorded sha256."""
    want = (r.manifest.get("data") or {}).get("tokenizer_sha256")
    for folder in (r.dir.parent.parent, Path(cfg.train.out_dir)):
        path = folder / "tokenizer.json"
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip() == json.dumps({"hpengine": "bytes"}):
            return "bytes", str(path)
        if want is None or sha256_text(text) == want:
            return text, str(path)
    return None, ""


def eos_id_of(r: Reader, tok: str | None) -> int | None:
    """The end-of-document id the run trained with: the token files' (when still readable), else the byte
    tokenizer's 0, else unknown."""
    for f in (r.manifest.get("data") or {}).get("files", []):
        try:
            tf = TokenFile(f)
        except Exception:  # noqa: BLE001 - moved or deleted data: the id is then looked up elsewhere
            continue
        eos = tf.eos_id
        tf.close()
        if eos >= 0:
            return eos
    if tok == "bytes":
        return 0
    if tok:
        from tokenizers import Tokenizer
        t = Tokenizer.from_str(tok)
        for cand in EOS_CANDIDATES:
            if t.token_to_id(cand) is not None:
                return t.token_to_id(cand)
    return None


# --- writers -----------------------------------------------------------------------------------
def _check_out(out: Path, fmt: str, force: bool) -> None:
    """Refuse, before reading anything, an output path that cannot or must not be written."""
    if out.name in ("", ".", ".."):
        raise CheckpointError(f"output '{out}' names no new file or folder: give a path such as "
                              f"'{out / ('model' if fmt == 'hf' else 'model.' + ('h5' if fmt == 'hdf5' else fmt))}'")
    if fmt != "hf" and out.is_dir():      # never replace a folder by a file, even with --force
        raise CheckpointError(f"output '{out}' is a folder; --format {fmt} writes one file: give a file path "
                              f"such as '{out / ('model.h5' if fmt == 'hdf5' else 'model.safetensors')}'")
    if out.exists() and not force:
        raise CheckpointError(f"'{out}' already exists (pass --force to replace it)")
    if not out.parent.is_dir():
        raise CheckpointError(f"output '{out}': folder '{out.parent}' does not exist (create it first)")


def _write_failed(out: Path, exc: BaseException) -> CheckpointError:
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).split("\n")[0]
    return CheckpointError(f"cannot write the export '{out}': {why}")


def _publish(tmp: Path, out: Path) -> None:
    """Rename tmp to out, replacing an existing out (file or folder) only now."""
    if out.exists() or out.is_symlink():
        old = out.with_name(out.name + ".old-export")
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    else:
        os.replace(tmp, out)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def export(path, out, fmt: str = "hdf5", params_only: bool = False, force: bool = False, note=print,
           model: int | None = None) -> dict:
    """Export checkpoint `path` (a step folder or a checkpoints root) to `out` in format fmt; returns
    {"path", "step", "tensors", "format"}. `note` receives the lines worth telling the user (skipped files).
    hf writes one model: `model` picks it from a several-model checkpoint (hdf5 and safetensors keep all)."""
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown export format {fmt!r} (choose from {', '.join(FORMATS)})")
    out = Path(out)
    _check_out(out, fmt, force)
    if fmt == "hdf5":
        tmp = out.with_name(out.name + ".export-tmp")
        try:
            info = export_hdf5(path, tmp, params_only=params_only)
            _publish(tmp, out)
        except (OSError, RuntimeError) as exc:         # h5py reports I/O errors as RuntimeError
            raise _write_failed(out, exc) from None
        finally:
            _remove(tmp)
        return {**info, "path": str(out), "format": fmt}
    save_file = _safetensors()
    r = Reader(path)          # refuse a model kind without an HF equivalent before reading any tensor
    cfg = _model_config(r.manifest["config"])
    r.close()
    if fmt == "hf" and cfg.model.kind not in HF_KINDS:
        raise CheckpointError(f"--format hf: model.kind = {cfg.model.kind!r} has no Hugging Face "
                              f"equivalent; supported kinds: {', '.join(HF_KINDS)} (use --format safetensors "
                              "or hdf5)")
    if fmt == "hf":
        select_model({}, cfg, model)          # a bad or missing --model before any tensor is read
    r, P = read_params(path)
    if fmt == "hf":
        P = select_model(P, cfg, model)
    dtype = str(next(iter(P.values())).dtype)
    tmp = out.with_name(out.name + ".export-tmp")
    _remove(tmp)
    try:
        if fmt == "safetensors":
            save_file({n: np.ascontiguousarray(a) for n, a in P.items()}, str(tmp),
                      metadata={"format": "hpengine", "config": r.manifest["config"], "step": str(r.step)})
            n = len(P)
        else:
            n = _write_hf(tmp, r, cfg, P, dtype, save_file, note)
        _publish(tmp, out)
    except (OSError, RuntimeError) as exc:
        raise _write_failed(out, exc) from None
    finally:
        _remove(tmp)
    return {"path": str(out), "step": r.step, "tensors": n, "format": fmt}


def _write_hf(folder: Path, r: Reader, cfg, P: dict, dtype: str, save_file, note) -> int:
    mcfg = cfg.model
    folder.mkdir(parents=True)
    state = gpt_to_hf(P, mcfg) if mcfg.kind == "gpt" else llama_to_hf(P, mcfg)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tok, where = run_tokenizer(r, cfg)
    eos = eos_id_of(r, tok)
    (folder / "config.json").write_text(json.dumps(hf_config(mcfg, dtype, eos), indent=2) + "\n")
    gen = {"bos_token_id": eos, "eos_token_id": eos, "max_length": mcfg.seq_len}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tok is None:
        note("note: no tokenizer.json of the run found next to the checkpoint (or under train.out_dir): "
             "no tokenizer files written")
    elif tok == "bytes":
        note("note: the run used hpengine's byte-level ids (token = UTF-8 byte): no Hugging Face tokenizer "
             "files written")
    else:
        (folder / "tokenizer.json").write_text(tok)
        from tokenizers import Tokenizer
        eos_text = Tokenizer.from_str(tok).id_to_token(eos) if eos is not None else None
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": mcfg.seq_len,
              "clean_up_tokenization_spaces": False}
        if eos_text is not None:
            tc.update(bos_token=eos_text, eos_token=eos_text)
        (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
        note(f"tokenizer files from {where}")
    return len(state)
