"""`hpengine ckpt export`: a checkpoint folder as one file for other tools (hdf5, safetensors, or a
Hugging Face model folder), built in a private folder beside OUT and renamed onto it at the end.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import tomllib
from pathlib import Path

import numpy as np

from hpengine.checkpoint.guard import as_created
from hpengine.checkpoint.shards import CheckpointError, Reader, export_hdf5, step_folder
from hpengine.config.load import from_dict
from hpengine.data.format import TokenFile, sha256_text
from hpengine.data.tokenizer import EOS_CANDIDATES
from hpengine.files.bars import bar, following
from hpengine.files.safe import write_file
from hpengine.models import hf_kinds, kind_of
from hpengine.models.moe_bias import saved_bias

#     hdf5          one HDF5 file of global tensors, parameters and (unless params_only) optimizer state: what
#                   checkpoint.init_from reads (checkpoint.export)
#     safetensors   one .safetensors file of the parameters under hpengine's names, global true-shape
#                   tensors in the checkpoint's dtype; metadata {"format": "hpengine", "config": TOML, "step"}
#     hf            a Hugging Face transformers model folder: config.json, generation_config.json,
#                   model.safetensors and, when the run used a Hugging Face tokenizer, its tokenizer files.
#                   gpt -> GPT2LMHeadModel; llama -> LlamaForCausalLM, or with routed experts
#                   MixtralForCausalLM, with model.qk_norm Qwen3ForCausalLM, with both Qwen3MoeForCausalLM;
#                   deepseek -> DeepseekV3ForCausalLM (router biases and multi-token prediction layers included).
FORMATS = ("hdf5", "safetensors", "hf")
HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json")


def _safetensors():
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise CheckpointError("export --format safetensors|hf needs the 'safetensors' package "
                              "(pip install safetensors)") from None

    def save(tensors: dict, path: str, metadata: dict) -> None:
        save_file(tensors, path, metadata=metadata)
        as_created(path)
    return save


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
    """The checkpoint's parameters as global true-shape arrays in their stored dtype, by hpengine name (a
    progress bar of the bytes read where a person watches)."""
    r = Reader(path)
    params = {}
    try:
        with bar(stored_bytes(r, ("param",)), "reading parameters", unit="B", scale=True) as shown:
            for name, shape in r.manifest["shapes"].items():
                pieces = r.by_tensor.get(("param", name))
                if not pieces:
                    raise CheckpointError(f"checkpoint '{r.dir}' has no parameter values for {name!r}")
                params[name] = r.read("param", name, tuple(slice(0, n) for n in shape)).astype(pieces[0]["dtype"])
                shown.update(params[name].nbytes)
    finally:
        r.close()
    return r, params


def stored_bytes(r: Reader, kinds) -> int:
    """Bytes of the global true-shape tensors of `kinds` (param and the optimizer's state tensors) in their
    stored dtypes."""
    total = 0
    for name, shape in r.manifest["shapes"].items():
        for kind in kinds:
            pieces = r.by_tensor.get((kind, name))
            if pieces:
                total += int(np.prod(shape, dtype=np.int64)) * np.dtype(pieces[0]["dtype"]).itemsize
    return total


def _folder_bytes(folder: Path) -> int:
    return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(folder) if e.is_file(follow_symlinks=False))


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
def checkpoint_folders(path) -> list[Path]:
    """The resolved folders of the checkpoint `path` names (its step folder, and the checkpoints root when
    that holds a `latest` pointer); empty when it names none (the command reports that itself)."""
    p = Path(path)
    if (p / "checkpoints").is_dir() and not os.path.lexists(p / "manifest.json") \
            and not os.path.lexists(p / "latest"):          # a run folder, as find_checkpoint reads it
        p = p / "checkpoints"
    try:
        step = step_folder(p).resolve()
    except (CheckpointError, OSError, ValueError):
        return []
    root = step.parent
    return [step] + ([root] if os.path.lexists(root / "latest") else [])


def refuse_checkpoint_target(out, checkpoint, what: str) -> None:
    """Refuse an output path whose folder is a checkpoint folder (it holds manifest.json or a `latest`
    pointer) or lies inside the checkpoint `checkpoint` names, and one that is or holds that checkpoint:
    writing there could replace the checkpoint's own files. `what` names the output in the message."""
    out = Path(out)
    parent = out.parent.resolve()
    target = parent / out.name                # a link at out itself is replaced, never followed
    folders = checkpoint_folders(checkpoint)
    outside = (folders[-1].parent if folders else parent.parent) / out.name
    for folder in folders:
        if folder.is_relative_to(target):
            raise CheckpointError(f"{what} '{out}' is or holds the checkpoint '{folder}'; give a new file or "
                                  "folder outside it")
    for name in ("manifest.json", "latest"):
        if os.path.lexists(parent / name):
            raise CheckpointError(f"{what} '{out}': '{parent}' is a checkpoint folder (it holds {name}); "
                                  f"write outside the checkpoint folders, e.g. '{outside}'")
    for folder in folders:
        if parent.is_relative_to(folder):
            raise CheckpointError(f"{what} '{out}' is inside the checkpoint '{folder}'; write outside the "
                                  f"checkpoint folders, e.g. '{outside}'")


def _check_out(out: Path, fmt: str, force: bool, checkpoint) -> None:
    """Refuse, before reading anything, an output path that cannot or must not be written."""
    if out.name in ("", ".", ".."):
        raise CheckpointError(f"output '{out}' names no new file or folder: give a path such as "
                              f"'{out / ('model' if fmt == 'hf' else 'model.' + ('h5' if fmt == 'hdf5' else fmt))}'")
    if fmt != "hf" and out.is_dir():      # never replace a folder by a file, even with --force
        raise CheckpointError(f"output '{out}' is a folder; --format {fmt} writes one file: give a file path "
                              f"such as '{out / ('model.h5' if fmt == 'hdf5' else 'model.safetensors')}'")
    if os.path.lexists(out) and not force:
        raise CheckpointError(f"'{out}' already exists (pass --force to replace it)")
    if not out.parent.is_dir():
        raise CheckpointError(f"output '{out}': folder '{out.parent}' does not exist (create it first)")
    refuse_checkpoint_target(out, checkpoint, "output")
    if fmt == "hf" and out.is_dir() and not out.is_symlink():     # --force: only a previous export goes
        other = sorted(p.name for p in out.iterdir() if p.name not in HF_FILES)
        if other or not (out / "config.json").is_file():
            held = ", ".join(other[:3]) + (" ..." if len(other) > 3 else "") if other else "no config.json"
            raise CheckpointError(f"output '{out}' is a folder that is not an hf export ({held}); --force "
                                  "replaces only a previous export: give a new folder")


def _write_failed(out: Path, exc: BaseException) -> CheckpointError:
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).split("\n")[0]
    return CheckpointError(f"ckpt export: cannot write '{out}': {why}")


def _stage(out: Path) -> Path:
    """A fresh private folder beside out (same file system, so the result is published by a rename)."""
    try:
        return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".export"))
    except OSError as exc:
        raise _write_failed(out, exc) from None


def _publish(new: Path, out: Path, stage: Path, force: bool) -> None:
    """Put the finished export `new` (inside the stage folder) in out's place: first renamed to a fresh
    name beside out, then renamed onto out (a link at out is replaced, never followed). With force an
    existing out is replaced by that rename when both are files; otherwise (an hf folder) it is first moved
    into the stage folder, deleted with it, and put back if the new one cannot take its place."""
    beside = out.with_name(f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.export")
    os.rename(new, beside)
    old = None
    try:
        if os.path.lexists(out):
            if not force:               # appeared since the check before the export
                raise CheckpointError(f"'{out}' already exists (pass --force to replace it)")
            if beside.is_dir() or (out.is_dir() and not out.is_symlink()):    # rename swaps like for like
                old = stage / ".replaced"
                os.rename(out, old)
        os.replace(beside, out)
    except BaseException:
        if old is not None and not os.path.lexists(out):
            os.rename(old, out)
        shutil.rmtree(beside) if beside.is_dir() and not beside.is_symlink() else beside.unlink(missing_ok=True)
        raise


# Global tensors are read at their true shape (the manifest's `shapes`), so tensor-parallel vocabulary
# padding never reaches an export. Every format is built inside a fresh private folder beside OUT (no link
# there to follow) and renamed onto OUT at the end; an existing OUT is refused unless force, and no export
# writes into a checkpoint folder or replaces one.
def export(path, out, fmt: str = "hdf5", params_only: bool = False, force: bool = False, note=print,
           model: int | None = None) -> dict:
    """Export checkpoint `path` (a step folder or a checkpoints root) to `out` in format fmt; returns
    {"path", "step", "tensors", "format"}. `note` receives the lines worth telling the user (skipped files).
    hf writes one model: `model` picks it from a several-model checkpoint (hdf5 and safetensors keep all)."""
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown export format {fmt!r} (choose from {', '.join(FORMATS)})")
    out = Path(out)
    _check_out(out, fmt, force, path)
    if fmt == "hdf5":
        r = Reader(path)
        total = stored_bytes(r, ("param",) if params_only else r.kinds)
        r.close()
        stage = _stage(out)
        try:
            with following(bar(total, "writing", unit="B", scale=True), lambda: _folder_bytes(stage)):
                info = export_hdf5(path, stage / out.name, params_only=params_only)
            _publish(stage / out.name, out, stage, force)
        except (OSError, RuntimeError) as exc:         # h5py reports I/O errors as RuntimeError
            raise _write_failed(out, exc) from None
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return {**info, "path": str(out), "format": fmt}
    save_file = _safetensors()
    from safetensors import SafetensorError
    r = Reader(path)          # refuse a model kind without an HF equivalent before reading any tensor
    cfg = _model_config(r.manifest["config"])
    r.close()
    if fmt == "hf" and kind_of(cfg.model.kind).hf is None:
        raise CheckpointError(f"--format hf: model.kind = {cfg.model.kind!r} has no Hugging Face "
                              f"equivalent; supported kinds: {', '.join(dict.fromkeys(hf_kinds().values()))} (use --format safetensors "
                              "or hdf5)")
    if fmt == "hf" and kind_of(cfg.model.kind).hf.export_refusal(cfg.model):
        raise CheckpointError(f"--format hf: {kind_of(cfg.model.kind).hf.export_refusal(cfg.model)} (use --format "
                              "safetensors or hdf5)")
    if fmt == "hf":
        select_model({}, cfg, model)          # a bad or missing --model before any tensor is read
    stage = _stage(out)                       # a read-only or full folder fails before the tensors are read
    try:
        r, P = read_params(path)
        if fmt == "hf":
            P = select_model(P, cfg, model)
        dtype = str(next(iter(P.values())).dtype)
        new = stage / out.name
        try:
            if fmt == "safetensors":
                save_file({n: np.ascontiguousarray(a) for n, a in P.items()}, str(new),
                          metadata={"format": "hpengine", "config": r.manifest["config"], "step": str(r.step)})
                n = len(P)
            else:
                n = _write_hf(new, r, cfg, P, dtype, save_file, note, model or 0)
            _publish(new, out, stage, force)
        except (OSError, RuntimeError, SafetensorError) as exc:
            raise _write_failed(out, exc) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return {"path": str(out), "step": r.step, "tensors": n, "format": fmt}


# What each kind's tensors are called and how they are laid out in Hugging Face is the kind's adapter's
# (models/hf_gpt.py: GPT-2's Conv1D is (in, out) as here, but its c_attn columns are permuted from the
# head-major fused qkv; models/hf_llama.py: every 2-D tensor but the embedding is transposed; docs/models.md).
def _write_hf(folder: Path, r: Reader, cfg, P: dict, dtype: str, save_file, note, model: int) -> int:
    mcfg = cfg.model
    folder.mkdir(parents=True)
    kind = kind_of(mcfg.kind)
    adapter = kind.hf
    # the router's selection biases are checkpoint state, not parameters (models/moe_bias.py)
    state = {**adapter.to_hf(P, mcfg), **kind.hf_bias_out(saved_bias(r.manifest["state"], model), mcfg)}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tok, where = run_tokenizer(r, cfg)
    eos = eos_id_of(r, tok)
    write_file(folder / "config.json", json.dumps(adapter.hf_config(mcfg, dtype, eos), indent=2) + "\n",
               overwrite=False)
    # no max_length: transformers' generate(..., max_new_tokens=N) would warn that both are set; the context
    # limit is config.json's positions (and the tokenizer's model_max_length)
    gen = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}
    write_file(folder / "generation_config.json", json.dumps(gen, indent=2) + "\n", overwrite=False)
    if tok is None:
        note("note: no tokenizer.json of the run found next to the checkpoint (or under train.out_dir): "
             "no tokenizer files written")
    elif tok == "bytes":
        note("note: the run used hpengine's byte-level ids (token = UTF-8 byte): no Hugging Face tokenizer "
             "files written")
    else:
        write_file(folder / "tokenizer.json", tok, overwrite=False)
        from tokenizers import Tokenizer
        eos_text = Tokenizer.from_str(tok).id_to_token(eos) if eos is not None else None
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": mcfg.seq_len,
              "clean_up_tokenization_spaces": False}
        if eos_text is not None:
            tc.update(bos_token=eos_text, eos_token=eos_text)
        write_file(folder / "tokenizer_config.json", json.dumps(tc, indent=2) + "\n", overwrite=False)
        note(f"tokenizer files from {where}")
    return len(state)
