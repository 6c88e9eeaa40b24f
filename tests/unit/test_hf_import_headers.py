"""`checkpoint.init_from = "hf:DIR"` against hostile or broken folders: every test plants one bad thing in an
otherwise good GPT-2 folder (raw safetensors bytes written here with struct + json) - an index name that
leaves DIR, a link, a FIFO, a header field out of range, a config.json that is not an object - and the reader
refuses it when it is made (on every rank alike), with one CheckpointError line naming the file and the field;
through the command line it is one error line, exit 2, not a traceback."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from hpengine.checkpoint.hf_import import HFReader
from hpengine.checkpoint.shards import CheckpointError
from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.models import hf_gpt
from hpengine.run.build import build

TINY = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "train.global_batch=4", "runtime.backend='numpy'", "train.log_every=1000"]
BIAS = "transformer.ln_f.bias"                     # 16 float32 values: the tensor the tests spoil


@pytest.fixture(scope="module")
def model(small_corpus):
    """(model config, the run's true shapes, GPT2LMHeadModel tensors as float32) of a tiny gpt."""
    cfg = load_config(None, [*TINY, f"data.path={small_corpus}"])
    eng = build(cfg)
    tensors = {k: v.astype(np.float32) for k, v in hf_gpt.to_hf(eng.named_params(), cfg.model).items()}
    return cfg.model, eng.true_shapes(), tensors


def st_bytes(tensors: dict, edit=None, length=None) -> bytes:
    """A safetensors file: u64 header length, JSON header, data; `edit` changes the header dict first and
    `length` replaces the header length written."""
    header, data, at = {"__metadata__": {"format": "pt"}}, b"", 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + len(raw)]}
        data, at = data + raw, at + len(raw)
    if edit is not None:
        header = edit(header) or header
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def make(folder: Path, model, edit=None, length=None, config=None) -> Path:
    mcfg, _, tensors = model
    folder.mkdir(parents=True, exist_ok=True)
    hc = hf_gpt.hf_config(mcfg, "float32", None) if config is None else config
    (folder / "config.json").write_text(json.dumps(hc))
    (folder / "model.safetensors").write_bytes(st_bytes(tensors, edit, length))
    return folder


def load(folder, model) -> dict:
    """Every parameter, read as restore() reads it."""
    mcfg, shapes, _ = model
    r = HFReader(folder, mcfg, shapes)
    try:
        return {n: r.read("param", n, tuple(slice(0, k) for k in s)) for n, s in shapes.items()}
    finally:
        r.close()


def refused(folder, model, *words) -> str:
    """The one-line CheckpointError of making the reader, which must name `words`."""
    mcfg, shapes, _ = model
    with pytest.raises(CheckpointError) as info:
        HFReader(folder, mcfg, shapes)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith((f"checkpoint.init_from = 'hf:{folder}'", f"hf:{folder}")), msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_good_folder_loads(tmp_path, model):
    got = load(make(tmp_path / "good", model), model)
    assert np.array_equal(got["ln_f.b"], model[2][BIAS])


def test_good_sharded_folder_loads(tmp_path, model):
    f = make(tmp_path / "sharded", model)
    tensors = model[2]
    (f / "model.safetensors").unlink()
    names, wm = sorted(tensors), {}
    for i, part in enumerate((names[::2], names[1::2])):
        (f / f"model-{i}.safetensors").write_bytes(st_bytes({n: tensors[n] for n in part}))
        wm.update({n: f"model-{i}.safetensors" for n in part})
    (f / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    assert np.array_equal(load(f, model)["ln_f.b"], tensors[BIAS])


def sharded(folder: Path, model, name_of) -> Path:
    """A folder with an index whose weight_map names name_of(folder) for every tensor."""
    make(folder, model)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: name_of(folder) for n in model[2]}}))
    return folder


@pytest.mark.parametrize("how", ["dotdot", "absolute", "subfolder"])
def test_index_name_leaving_folder(tmp_path, model, how):
    outside = make(tmp_path / "outside", model)              # a good file to be lured to
    name = {"dotdot": lambda f: "../outside/model.safetensors", "subfolder": lambda f: "sub/model.safetensors",
            "absolute": lambda f: str(outside / "model.safetensors")}[how]
    if how == "subfolder":
        make(tmp_path / "dir" / "sub", model)
    f = sharded(tmp_path / "dir", model, name)
    refused(f, model, "model.safetensors.index.json weight_map", repr(name(f)))


def test_index_link_leading_out(tmp_path, model):
    outside = make(tmp_path / "outside", model)
    f = sharded(tmp_path / "dir", model, lambda f: "model-1.safetensors")
    os.symlink(outside / "model.safetensors", f / "model-1.safetensors")
    refused(f, model, "model-1.safetensors", "symbolic link")


@pytest.mark.parametrize("which", ["model.safetensors", "config.json"])
def test_link_not_followed(tmp_path, model, which):
    outside = make(tmp_path / "outside", model)
    f = make(tmp_path / "dir", model)
    (f / which).unlink()
    os.symlink(outside / which, f / which)
    refused(f, model, f"{f / which}", "symbolic link")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("which", ["config.json", "model.safetensors", "model-1.safetensors",
                                   "model.safetensors.index.json"])
def test_fifo_refused_promptly(tmp_path, model, which):
    f = sharded(tmp_path / "dir", model, lambda f: "model-1.safetensors") if which.startswith("model-1") \
        else make(tmp_path / "dir", model)
    if which == "model.safetensors.index.json":
        (f / "model.safetensors").unlink()
    if (f / which).exists():
        (f / which).unlink()
    os.mkfifo(f / which)
    refused(f, model, f"{f / which}", "not a regular file (a FIFO)")


def _set(name, key, value=None, drop=False):
    def edit(h):
        if drop:
            del h[name][key]
        else:
            h[name][key] = value
    return edit


HEADERS = {   # id: (header edit, header length or None, words the message must hold)
    "header-length-u64-max": (None, 2**64 - 1, ["header length 18446744073709551615", "at most"]),
    "header-length-past-end": (None, 10**6, ["header length 1000000", "at most"]),
    "shape-888-PiB": (_set(BIAS, "shape", [888, 2**50]), None, [BIAS, "shape [888, 1125899906842624]",
                                                                  "data_offsets"]),
    "offsets-past-end": (_set(BIAS, "data_offsets", [10**9, 10**9 + 64]), None,
                         [BIAS, "data_offsets [1000000000, 1000000064]", "past the end"]),
    "offsets-short": (lambda h: h[BIAS]["data_offsets"].__setitem__(1, h[BIAS]["data_offsets"][0] + 32), None,
                      [BIAS, "(32 bytes)", "shape [16] of F32 needs 64 bytes"]),
    "offsets-long": (lambda h: h[BIAS]["data_offsets"].__setitem__(1, h[BIAS]["data_offsets"][0] + 128), None,
                     [BIAS, "(128 bytes)", "needs 64 bytes"]),
    "offsets-reversed": (_set(BIAS, "data_offsets", [64, 0]), None, [BIAS, "data_offsets [64, 0]", "start <= end"]),
    "offsets-missing": (_set(BIAS, "data_offsets", drop=True), None, [BIAS, "no data_offsets"]),
    "offsets-not-ints": (_set(BIAS, "data_offsets", ["0", "64"]), None, [BIAS, "data_offsets ['0', '64']"]),
    "header-list": (lambda h: [1, 2], None, ["header is a JSON list", "object"]),
    "entry-list": (lambda h: h.__setitem__(BIAS, [0, 64]), None, [BIAS, "is a JSON list", "dtype, shape"]),
    "shape-string": (_set(BIAS, "shape", "16"), None, [BIAS, "shape '16'", "at most 32 integers, each 0 <= n"]),
    "shape-negative": (_set(BIAS, "shape", [-16]), None, [BIAS, "shape [-16]", "each 0 <= n < 2**63"]),
    "shape-70-dims": (_set(BIAS, "shape", [16] + [1] * 70), None, [BIAS, "shape [16, 1, 1,", "at most 32"]),
    "shape-empty-but-huge": (lambda h: h[BIAS].update(shape=[0, 2**70], data_offsets=[0, 0]), None,
                             [BIAS, "shape [0, 1180591620717411303424]", "each 0 <= n < 2**63"]),
    "dtype-unknown": (_set(BIAS, "dtype", "Q9"), None, [BIAS, "dtype 'Q9'", "supported: F64, F32, F16, BF16"]),
    "dtype-unreadable": (lambda h: h[BIAS].update(dtype="I8", shape=[64]), None,
                         [BIAS, "dtype 'I8'", "cannot be read", "supported: F64"]),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_bad_header(tmp_path, model, case):
    edit, length, words = HEADERS[case]
    f = make(tmp_path / case, model, edit, length)
    refused(f, model, str(f / "model.safetensors"), *words)


def test_short_file(tmp_path, model):
    f = make(tmp_path / "short", model)
    (f / "model.safetensors").write_bytes(b"\x01\x02\x03")
    refused(f, model, str(f / "model.safetensors"), "3 bytes")


def test_unused_tensor_checked_too(tmp_path, model):
    """A tensor the run never reads is still checked: its offsets cannot point past the file."""
    f = make(tmp_path / "extra", model, lambda h: h.__setitem__("extra", {"dtype": "U8", "shape": [8],
                                                                           "data_offsets": [0, 10**12]}))
    refused(f, model, "tensor extra", "past the end")


@pytest.mark.parametrize("text, words", [
    ("[1, 2]", ["config.json", "is a JSON list", "object"]),
    ('{"architectures": "GPT2LMHeadModel"}', ["architectures 'GPT2LMHeadModel'", "list"]),
    ('{"architectures": [["GPT2LMHeadModel"]]}', ["architectures [['GPT2LMHeadModel']]", "list"]),
])
def test_bad_config(tmp_path, model, text, words):
    f = make(tmp_path / "config", model)
    (f / "config.json").write_text(text)
    refused(f, model, *words)


def test_huge_config(tmp_path, model):
    f = make(tmp_path / "huge", model)
    with open(f / "config.json", "wb") as fh:                # sparse: 65 MiB of nothing, instantly
        fh.truncate(65 << 20)
    refused(f, model, str(f / "config.json"), "bytes, more than")


@pytest.mark.parametrize("index, words", [
    ("[1]", ["model.safetensors.index.json", "is a JSON list", "object"]),
    ('{"weight_map": ["model-1.safetensors"]}', ["weight_map", "['model-1.safetensors']", "object"]),
    ('{"weight_map": {"a": 7}}', ["weight_map", "7 is not a file name"]),
])
def test_bad_index(tmp_path, model, index, words):
    f = make(tmp_path / "index", model)
    (f / "model.safetensors").unlink()
    (f / "model.safetensors.index.json").write_text(index)
    refused(f, model, *words)


def test_command_line_one_line(tmp_path, capsys, small_corpus, model):
    """What a user runs: `hpengine train` with init_from pointing at a spoiled folder is one line, exit 2."""
    f = make(tmp_path / "cli", model, _set(BIAS, "data_offsets", [10**9, 10**9 + 64]))
    args = ["train"]
    for item in [*TINY, f"data.path={small_corpus}", f"train.out_dir={tmp_path / 'run'}", "train.steps=1",
                 f"checkpoint.init_from=hf:{f}"]:
        args += ["--set", item]
    capsys.readouterr()
    rc = main(args)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("hpengine: error: ") and BIAS in lines[0] and "past the end" in lines[0], lines[0]
