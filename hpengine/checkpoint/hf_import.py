"""`checkpoint.init_from = "hf:DIR"`: start a run from a local Hugging Face model folder.
The inverse of `hpengine ckpt export --format hf` (checkpoint/export.py): HFReader serves hpengine-named global
tensors from DIR's untrusted safetensors, each checked before it is mapped and read lazily.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from hpengine.checkpoint import hf_fp8
from hpengine.checkpoint.shards import CheckpointError, read_region
from hpengine.files import UnsafeFile, inside, open_regular, read_text
from hpengine.models import hf_kinds, hf_refused, kind_of
from hpengine.models.hf_common import HFMismatch
from hpengine.models.moe_bias import KEY as BIAS_KEY

PREFIX = "hf:"
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
           "I64": np.int64, "I32": np.int32}
_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
         "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "C64": 64,
         "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}     # every safetensors dtype, for the byte counts
# The folder is untrusted (hpengine/files): index names must be bare
# names inside DIR, no link is followed, a FIFO is refused, and each safetensors header is checked in full
# (length; every entry's dtype, shape and data_offsets against the file's size) before a tensor is mapped.
HEADER_LIMIT = 100_000_000                          # the safetensors library's own cap on a header
TEXT_LIMIT = 64 << 20                               # config.json, model.safetensors.index.json


def _unsafe(where: str, exc: Exception) -> CheckpointError:
    hint = ("; copy the folder without links first (cp -rL), as a Hugging Face cache snapshot links to its "
            "blobs") if "symbolic link" in str(exc) else ""
    return CheckpointError(f"{where}: {exc}{hint}")


def _a(value) -> str:
    """What a JSON value is, for a message: 'a JSON list', 'a JSON string', ..."""
    return "a JSON " + {dict: "object", list: "list", str: "string", bool: "boolean"}.get(type(value), "value")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:96] + " ..."


def _unreadable(at: str, name: str, code) -> CheckpointError:
    return CheckpointError(f"{at}: tensor {name} has dtype {_short(code)}, which cannot be read "
                           f"(supported: {', '.join(_DTYPES)}, and {hf_fp8.FP8} beside a <name>{hf_fp8.SUFFIX} tensor "
                           "of block scales)")


def _json_object(path: Path, where: str, role: str) -> dict:
    """The JSON object in file `path` (read as a regular file of at most TEXT_LIMIT bytes)."""
    try:
        value = json.loads(read_text(path, role, TEXT_LIMIT))
    except UnsafeFile as exc:
        raise _unsafe(where, exc) from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}: '{path}' is missing, unreadable or not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: '{path}' is {_a(value)}; it must be a JSON object")
    return value


def _entry(e, name: str, at: str, room: int) -> tuple:
    """(dtype code, shape, start, end) of header entry `e` of tensor `name`, checked against the `room`
    bytes of data the file holds after its header."""
    what = f"{at}: tensor {name}"
    if not isinstance(e, dict):
        raise CheckpointError(f"{what} is {_a(e)}; it must be an object with dtype, shape and data_offsets")
    code, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(code, str) or code not in _BITS:
        raise _unreadable(at, name, code)
    if not isinstance(shape, list) or len(shape) > 32 or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
        raise CheckpointError(f"{what} has shape {_short(shape)}; a shape is a list of at most 32 integers, "
                              "each 0 <= n < 2**63")
    if offsets is None:
        raise CheckpointError(f"{what} has no data_offsets; each tensor needs \"data_offsets\": [start, end]")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{what} has data_offsets {_short(offsets)}; they must be two integers "
                              "[start, end] with 0 <= start <= end")
    a, b = offsets
    if b > room:
        raise CheckpointError(f"{what} has data_offsets [{a}, {b}], past the end of the {room} data bytes "
                              "the file holds after its header")
    elements = 0 if 0 in shape else 1
    for d in shape:                           # stops past 2**64: a hostile shape costs no time
        elements *= d
        if elements >> 64:
            break
    bits = elements * _BITS[code]
    if bits % 8 or b - a != bits // 8:
        need = f"{bits // 8}" if bits % 8 == 0 else f"{bits / 8:g} (not a whole number of)"
        need = "over 2**64" if elements >> 64 else need
        raise CheckpointError(f"{what} has data_offsets [{a}, {b}] ({b - a} bytes) but shape {_short(shape)} "
                              f"of {code} needs {need} bytes; the two must agree")
    return code, tuple(shape), a, b


def _header(path: Path, where: str) -> dict:
    """HF name -> (path, dtype code, shape, start byte, end byte) of one .safetensors file, all checked."""
    at = f"{where}: '{path}'"
    try:
        with open_regular(path, "weights") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"{at} is {size} bytes, too short for a safetensors file (an 8-byte "
                                      "header length, the header, the data)")
            n = struct.unpack("<Q", f.read(8))[0]
            most = min(size - 8, HEADER_LIMIT)
            if n > most:
                raise CheckpointError(f"{at} has header length {n}; it can be at most {most} (the file's "
                                      f"{size} bytes less 8, and never over {HEADER_LIMIT})")
            text = f.read(n)
    except UnsafeFile as exc:
        raise _unsafe(where, exc) from None
    except OSError as exc:
        raise CheckpointError(f"{at} is not a readable safetensors file ({exc})") from None
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{at}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{at}: the header is {_a(header)}; it must be a JSON object of tensor entries")
    out = {}
    for name, e in header.items():
        if name != "__metadata__":
            code, shape, a, b = _entry(e, name, at, size - 8 - n)
            out[name] = (path, code, shape, 8 + n + a, 8 + n + b)
    return out


class _Safetensors:
    """Lazy, memory-mapped reads of the tensors of one or more .safetensors files (bfloat16 included; fp8
    block-quantised weights dequantised, their scale tensors consumed: checkpoint/hf_fp8.py)."""

    def __init__(self, files: list[Path], where: str, block: tuple | None = None):
        self.entries = {}                     # HF name -> (path, dtype code, shape, start byte, end byte)
        for path in files:
            self.entries.update(_header(path, where))
        self.where, self.block = where, block
        # keyed by the weight's entry, which the adapters' renaming (full_names) keeps
        self.scales = hf_fp8.fold(self.entries, block, where)

    def shape(self, name):
        return self.entries[name][2]

    def check_readable(self, name):
        path, code = self.entries[name][:2]
        scale = self.scales.get(self.entries[name])
        if scale is not None:
            path, code = scale[:2]
            name += hf_fp8.SUFFIX
        if code not in _DTYPES:
            raise _unreadable(f"{self.where}: '{path}'", name, code)

    def get(self, name) -> np.ndarray:
        entry = self.entries[name]
        scale = self.scales.get(entry)
        if scale is not None:
            bits, scales = self._read(name, entry, np.uint8), self._read(name + hf_fp8.SUFFIX, scale)
            return hf_fp8.dequantize(bits, scales, self.block)
        return self._read(name, entry)

    def _read(self, name, entry, dtype=None) -> np.ndarray:
        """float64 values of the tensor at header entry `entry` (`dtype`: its raw elements instead)."""
        path, code, shape, a, b = entry
        dt = np.dtype(dtype or _DTYPES[code]).newbyteorder("<")
        count = (b - a) // dt.itemsize
        try:
            with open_regular(path, "weights") as f:
                if os.fstat(f.fileno()).st_size < b:
                    raise CheckpointError(f"{self.where}: '{path}' is shorter than tensor {name}'s data "
                                          f"(bytes {a}..{b}): it changed after it was checked")
                raw = np.memmap(f, dtype=dt, mode="r", offset=a, shape=(count,)) if count else np.zeros(0, dt)
        except (UnsafeFile, OSError) as exc:
            raise _unsafe(self.where, exc) from None
        if dtype is not None:
            return np.asarray(raw).reshape(shape)
        if code == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        return np.asarray(raw, dtype=np.float64).reshape(shape)


# DIR holds config.json and model.safetensors (or sharded model-*.safetensors with
# model.safetensors.index.json) of a GPT2LMHeadModel (-> model.kind = "gpt"), a LlamaForCausalLM,
# MixtralForCausalLM, Qwen3ForCausalLM or Qwen3MoeForCausalLM (-> "llama") or a DeepseekV3ForCausalLM (-> "deepseek").
def _files(folder: Path, where: str) -> list[Path]:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if os.path.lexists(single):
        return [single]                       # a link or FIFO there is refused when it is opened
    if os.path.lexists(index):
        wm = _json_object(index, where, "index").get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{where}: '{index}' has weight_map {_short(wm)}; it must be a non-empty "
                                  "object of tensor name -> shard file name")
        try:
            files = sorted({inside(folder, f, f"{index} weight_map", bare=True) for f in wm.values()})
        except UnsafeFile as exc:
            raise _unsafe(where, exc) from None
        for f in files:
            if not os.path.lexists(f):
                raise CheckpointError(f"{where}: shard '{f}' named in {index.name} is missing")
        return files
    raise CheckpointError(f"{where}: no model.safetensors or model.safetensors.index.json in '{folder}' "
                          "(only safetensors weights can be read)")


def _check_config(hc: dict, mcfg, where: str) -> str:
    """The model kind of config.json; raises when its shape differs from the run's [model] (the kind's
    adapter checks its own fields)."""
    archs = hc.get("architectures") or [None]
    if not isinstance(archs, list) or not isinstance(archs[0], (str, type(None))):
        raise CheckpointError(f"{where}: config.json has architectures {_short(archs)}; it must be a list naming "
                              "the model class, as [\"GPT2LMHeadModel\"]")
    arch = archs[0]
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


# The inverse of `hpengine ckpt export
# --format hf` (checkpoint/export.py); the names and layout changes are the kind's adapter's (models/hf_gpt.py:
# GPT-2's c_attn columns [q|k|v][head][d] permuted back to hpengine's head-major qkv; models/hf_llama.py: the
# (out, in) linears transposed, per-expert matrices stacked). HFReader serves hpengine-named global tensors through the same read() as
# checkpoint.ExportReader, so every layout (tensor-parallel slices, sharded ranges, pipeline stages) loads
# it unchanged; each tensor is read lazily (memory-mapped) when a rank asks for it.
#
# Everything that can be checked without reading tensor data is checked when the reader is made, on every
# rank alike: the architecture, config.json against the run's [model], every tensor's presence and shape,
# and tied against untied output heads. A kind whose adapter carries the router's selection biases gives them as
# `manifest`'s state, which the engine loads as a checkpoint's; tensors the folder holds twice (DeepSeek's MTP layers'
# embed_tokens and shared_head.head) are compared with the tensor they copy as each region of it is read.
class HFReader:
    """checkpoint.ExportReader's read() over a Hugging Face model folder, for checkpoint.init_from = "hf:DIR".
    `shapes` are the run's true (unpadded) global shapes by hpengine name (engine.true_shapes())."""

    step = 0
    manifest = None          # {"state": {"router_bias": ...}} where the folder has router biases

    def __init__(self, folder, mcfg, shapes: dict):
        self.dir = Path(folder)
        self.where = where = f"checkpoint.init_from = 'hf:{folder}'"
        hc = _json_object(self.dir / "config.json", where, "config")
        kind = _check_config(hc, mcfg, f"hf:{folder}")
        self.st = _Safetensors(_files(self.dir, where), where, hf_fp8.block_size(hc, where))
        k = kind_of(kind)
        adapter = k.hf
        self.st.entries = adapter.full_names(self.st.entries)
        self.map, self.copies = adapter.from_hf_map(mcfg), k.hf_copies(mcfg)
        extra = sorted(set(shapes) - set(self.map))
        if extra:
            raise CheckpointError(f"{where}: the run has tensors {extra[:4]} with no Hugging Face counterpart")
        for name, (hf, fn) in self.map.items():
            for h in _sources(hf):
                if h not in self.st.entries:
                    raise CheckpointError(f"{where}: tensor {h} (hpengine {name}) is missing")
                self.st.check_readable(h)
            got = tuple(self._get(hf, fn, lambda h: np.empty(self.st.shape(h), dtype=np.uint8)).shape)
            want = tuple(shapes.get(name, got))
            if got != want:
                raise CheckpointError(f"{where}: tensor {_sources(hf)[0]} has shape {list(self.st.shape(_sources(hf)[0]))}"
                                      f"{f' (one of {len(hf)})' if isinstance(hf, tuple) else ''}, which gives "
                                      f"{name} {list(got)} but the run's {name} is {list(want)}")
        for name, held in self.copies.items():
            main = _sources(self.map[name][0])[0]
            for h, _ in held:
                self._tensor_entry(h, f"a copy of {main}")
                if self.st.shape(h) != self.st.shape(main):
                    raise CheckpointError(f"{where}: tensor {h} has shape {list(self.st.shape(h))}; as a copy of {main} "
                                          f"it must be {list(self.st.shape(main))}")
        try:
            bias = k.hf_bias_in(lambda h: self.st.get(self._tensor_entry(h, "a router bias")), mcfg, f"hf:{folder}")
        except HFMismatch as exc:
            raise CheckpointError(str(exc)) from None
        if bias is not None:
            self.manifest = {"state": {BIAS_KEY: [bias.tolist()]}}

    def _tensor_entry(self, h: str, what: str) -> str:
        """h, after checking that the folder holds it readable (`what` it is, for the message)."""
        if h not in self.st.entries:
            raise CheckpointError(f"{self.where}: tensor {h} ({what}) is missing")
        self.st.check_readable(h)
        return h

    @staticmethod
    def _get(hf, fn, get):
        """hpengine's array from the Hugging Face tensor(s) `hf` (a name, or the tuple a tensor is stacked from)."""
        return fn([get(h) for h in hf]) if isinstance(hf, tuple) else fn(get(hf))

    def read(self, kind, name, region):
        """float64 values of global region of hpengine parameter `name`; beyond its true shape, 0."""
        if kind != "param" or name not in self.map:
            raise CheckpointError(f"{self.where} has no {kind} {name!r}")
        hf, fn = self.map[name]
        out = read_region(self._get(hf, fn, self.st.get), region)
        for h, f in self.copies.get(name, ()):
            if not np.array_equal(read_region(f(self.st.get(h)), region), out, equal_nan=True):
                raise CheckpointError(f"{self.where}: tensor {h} differs from {_sources(hf)[0]} (hpengine {name}), "
                                      "which it copies; a folder holds the same values in both")
        return out

    def close(self):
        self.st = None
