"""`checkpoint.init_from = "hf:DIR"`: start a run from a local Hugging Face model folder.

DIR holds config.json and model.safetensors (or sharded model-*.safetensors with
model.safetensors.index.json) of a GPT2LMHeadModel (-> model.kind = "gpt") or a LlamaForCausalLM,
MixtralForCausalLM, Qwen3ForCausalLM or Qwen3MoeForCausalLM (-> "llama"). The inverse of `hpengine ckpt export
--format hf` (checkpoint/export.py); the names and layout changes are the kind's adapter's (models/hf_gpt.py:
GPT-2's c_attn columns [q|k|v][head][d] permuted back to hpengine's head-major qkv; models/hf_llama.py: the
(out, in) linears transposed, per-expert matrices stacked). HFReader serves hpengine-named global tensors through the same read() as
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
from hpengine.models import hf_kinds, hf_refused, kind_of
from hpengine.models.hf_common import HFMismatch

PREFIX = "hf:"
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
           "I64": np.int64, "I32": np.int32}


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


def _check_config(hc: dict, mcfg, where: str) -> str:
    """The model kind of config.json; raises when its shape differs from the run's [model] (the kind's
    adapter checks its own fields)."""
    arch = (hc.get("architectures") or [None])[0]
    arch_kind = hf_kinds()
    kind = arch_kind.get(arch)
    if arch in hf_refused():
        raise CheckpointError(f"{where}: architecture {arch!r} cannot be read: {hf_refused()[arch]}")
    if kind is None:
        raise CheckpointError(f"{where}: architecture {arch!r} is not supported; supported: "
                              + ", ".join(f"{a} (model.kind = {k!r})" for a, k in arch_kind.items()))
    if mcfg.kind != kind:
        raise CheckpointError(f"{where} is a {arch} (model.kind = {kind!r}) but model.kind = {mcfg.kind!r}")
    try:
        tied = kind_of(kind).hf.check_config(hc, mcfg, where)
    except HFMismatch as exc:
        raise CheckpointError(str(exc)) from None
    if tied != bool(mcfg.tie_head):
        raise CheckpointError(
            f"{where} has tied embeddings (tie_word_embeddings = true) but model.tie_head = false"
            if tied else
            f"{where} has an untied output head (tie_word_embeddings = false) but model.tie_head = true")
    return kind


def _sources(hf) -> tuple:
    return hf if isinstance(hf, tuple) else (hf,)


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
        adapter = kind_of(kind).hf
        self.st.entries = adapter.full_names(self.st.entries)
        self.map = adapter.from_hf_map(mcfg)
        extra = sorted(set(shapes) - set(self.map))
        if extra:
            raise CheckpointError(f"{where}: the run has tensors {extra[:4]} with no Hugging Face counterpart")
        for name, (hf, fn) in self.map.items():
            for h in _sources(hf):
                if h not in self.st.entries:
                    raise CheckpointError(f"{where}: tensor {h} (hpengine {name}) is missing")
            got = tuple(self._get(hf, fn, lambda h: np.empty(self.st.shape(h), dtype=np.uint8)).shape)
            want = tuple(shapes.get(name, got))
            if got != want:
                raise CheckpointError(f"{where}: tensor {_sources(hf)[0]} has shape {list(self.st.shape(_sources(hf)[0]))}"
                                      f"{f' (one of {len(hf)})' if isinstance(hf, tuple) else ''}, which gives "
                                      f"{name} {list(got)} but the run's {name} is {list(want)}")

    @staticmethod
    def _get(hf, fn, get):
        """hpengine's array from the Hugging Face tensor(s) `hf` (a name, or the tuple a tensor is stacked from)."""
        return fn([get(h) for h in hf]) if isinstance(hf, tuple) else fn(get(hf))

    def read(self, kind, name, region):
        """float64 values of global region of hpengine parameter `name`; beyond its true shape, 0."""
        if kind != "param" or name not in self.map:
            raise CheckpointError(f"{self.where} has no {kind} {name!r}")
        hf, fn = self.map[name]
        return read_region(self._get(hf, fn, self.st.get), region)

    def close(self):
        self.st = None
