"""`checkpoint.init_from = "hf:DIR"` without torch: a folder written by `hpengine ckpt export --format hf`
loads back to exactly the checkpoint's parameters (gpt untied and tied, llama with grouped-query attention),
through restore() and through the command line with a zero-LR step; the c_attn permutation inverts
export's; what is wrong with a folder (architecture, [model] shape, a missing tensor, a tensor's shape,
tied against untied) is one error line, exit 2. Against transformers: tests/interop/test_hf_import.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hpengine.models import hf_gpt
from hpengine.checkpoint.shards import Reader
from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.run.build import build
from hpengine.run.train import restore

safetensors_numpy = pytest.importorskip("safetensors.numpy")

TINY = ["model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "train.global_batch=4",
        "runtime.backend='numpy'", "train.log_every=1000"]
KIND = {"gpt": ["model.kind='gpt'"], "gpt_tied": ["model.kind='gpt'", "model.tie_head=true"],
        "llama": ["model.kind='llama'", "model.n_kv_heads=1", "model.ffn_hidden=24"]}


def sets(corpus, out, *extra) -> list[str]:
    return [*TINY, f"data.path={corpus}", f"train.out_dir={out}", *extra]


def cli(capsys, *args):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def train_args(items) -> list[str]:
    args = ["train"]
    for item in items:
        args += ["--set", item]
    return args


def global_params(root: Path) -> dict:
    r = Reader(root)
    try:
        return {n: r.read("param", n, tuple(slice(0, k) for k in s)) for n, s in r.manifest["shapes"].items()}
    finally:
        r.close()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, small_corpus):
    """kind -> (run folder of a 2-step run, its hf export folder)."""
    root, out = tmp_path_factory.mktemp("hf_import"), {}
    for kind, extra in KIND.items():
        run = root / kind
        assert main(train_args(sets(small_corpus, run, *extra, "train.steps=2"))) == 0, kind
        assert main(["ckpt", "export", str(run / "checkpoints"), str(root / f"{kind}-hf"), "--format", "hf"]) == 0
        out[kind] = (run, root / f"{kind}-hf")
    return out


def test_qkv_inverse():
    a = np.random.default_rng(0).standard_normal((12, 36))
    assert np.array_equal(hf_gpt.qkv_from_hf(hf_gpt.qkv_to_hf(a, 3), 3), a)
    b = np.arange(36.0)
    assert np.array_equal(hf_gpt.qkv_to_hf(hf_gpt.qkv_from_hf(b, 3), 3), b)


@pytest.mark.parametrize("kind", list(KIND))
def test_round_trip(tmp_path, capsys, small_corpus, exported, kind):
    run, hf = exported[kind]
    want = global_params(run / "checkpoints")
    cfg = load_config(None, sets(small_corpus, tmp_path / "unused", *KIND[kind], f"checkpoint.init_from=hf:{hf}"))
    eng = build(cfg)
    assert restore(eng, cfg, None) == 0
    got = eng.named_params()
    assert sorted(got) == sorted(want)
    for name, arr in got.items():
        assert np.array_equal(arr, want[name]), name

    out = tmp_path / "zero-lr"           # the command line: a zero-LR step keeps the imported values
    rc, stdout, err = cli(capsys, *train_args(sets(small_corpus, out, *KIND[kind], f"checkpoint.init_from=hf:{hf}",
                                                   "optim.lr=0", "train.steps=1")))
    assert rc == 0, err
    assert f"parameters initialised from hf:{hf}" in stdout
    again = global_params(out / "checkpoints")
    for name, arr in want.items():
        assert np.array_equal(again[name], arr), name


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    hc = json.loads(path.read_text())
    hc.update(changes)
    path.write_text(json.dumps(hc))


def _edit_tensors(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    t = safetensors_numpy.load_file(str(path))
    fn(t)
    safetensors_numpy.save_file(t, str(path))


def _error(capsys, tmp_path, corpus, folder, kind, *extra) -> str:
    rc, _, err = cli(capsys, *train_args(sets(corpus, tmp_path / "run", *KIND[kind],
                                              f"checkpoint.init_from=hf:{folder}", "train.steps=1", *extra)))
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("hpengine: error: "), lines[0]
    return lines[0]


def test_errors(tmp_path, capsys, small_corpus, exported):
    _, gpt = exported["gpt"]
    _, llama = exported["llama"]

    f = _copy(gpt, tmp_path / "arch")
    _edit_config(f, architectures=["BertForMaskedLM"])
    line = _error(capsys, tmp_path, small_corpus, f, "gpt")
    assert "architecture 'BertForMaskedLM' is not supported" in line
    assert "GPT2LMHeadModel" in line and "LlamaForCausalLM" in line

    line = _error(capsys, tmp_path, small_corpus, gpt, "gpt", "model.d_model=32")
    assert f"hf:{gpt} has n_embd 16 but model.d_model = 32" in line
    line = _error(capsys, tmp_path, small_corpus, llama, "llama", "model.d_model=32")
    assert f"hf:{llama} has hidden_size 16 but model.d_model = 32" in line
    line = _error(capsys, tmp_path, small_corpus, llama, "gpt")
    assert "is a LlamaForCausalLM (model.kind = 'llama') but model.kind = 'gpt'" in line

    f = _copy(llama, tmp_path / "missing")
    _edit_tensors(f, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    line = _error(capsys, tmp_path, small_corpus, f, "llama")
    assert "tensor model.layers.1.mlp.up_proj.weight (hpengine h.1.mlp.up.w) is missing" in line

    f = _copy(gpt, tmp_path / "shape")
    _edit_tensors(f, lambda t: t.update({"transformer.h.0.mlp.c_fc.bias": np.zeros(63, np.float32)}))
    line = _error(capsys, tmp_path, small_corpus, f, "gpt")
    assert "tensor transformer.h.0.mlp.c_fc.bias has shape [63]" in line and "is [64]" in line

    line = _error(capsys, tmp_path, small_corpus, exported["gpt_tied"][1], "gpt")
    assert "has tied embeddings (tie_word_embeddings = true) but model.tie_head = false" in line
    line = _error(capsys, tmp_path, small_corpus, gpt, "gpt_tied")
    assert "has an untied output head (tie_word_embeddings = false) but model.tie_head = true" in line

    line = _error(capsys, tmp_path, small_corpus, tmp_path / "nowhere", "gpt")
    assert "config.json" in line and "missing" in line


def test_sharded_folder(tmp_path, small_corpus, exported):
    """model-0000x-of-00002.safetensors with model.safetensors.index.json, as save_pretrained shards."""
    run, hf = exported["llama"]
    f = _copy(hf, tmp_path / "sharded")
    t = safetensors_numpy.load_file(str(f / "model.safetensors"))
    (f / "model.safetensors").unlink()
    names = sorted(t)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        safetensors_numpy.save_file({n: t[n] for n in part}, str(f / file))
        weight_map.update({n: file for n in part})
    (f / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = load_config(None, sets(small_corpus, tmp_path / "unused", *KIND["llama"], f"checkpoint.init_from=hf:{f}"))
    eng = build(cfg)
    restore(eng, cfg, None)
    want = global_params(run / "checkpoints")
    for name, arr in eng.named_params().items():
        assert np.array_equal(arr, want[name]), name
