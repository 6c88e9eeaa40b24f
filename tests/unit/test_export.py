"""`hpengine ckpt export --format hdf5|safetensors|hf` without torch: the safetensors file holds the
checkpoint's global tensors, the GPT-2 qkv permutation puts every column where GPT-2 reads it, the llama
map is a rename and a transpose, an mlp has no Hugging Face export, an existing OUT is kept without --force
and --params-only leaves the optimizer state out. Loading into transformers: tests/interop/test_hf_export.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpengine.checkpoint import export as ex
from hpengine.models import hf_gpt, hf_llama
from hpengine.checkpoint.shards import Reader
from hpengine.cli.commands import main

safetensors_numpy = pytest.importorskip("safetensors.numpy")

TINY = ["model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "train.global_batch=4",
        "runtime.backend='numpy'", "train.log_every=1000", "train.steps=2", "checkpoint.every=2"]
KIND = {"gpt": ["model.kind='gpt'"], "gpt_tied": ["model.kind='gpt'", "model.tie_head=true"],
        "llama": ["model.kind='llama'", "model.n_kv_heads=1", "model.ffn_hidden=24"],
        "mlp": ["model.kind='mlp'"]}


def cli(capsys, *args):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus):
    """kind -> run folder holding checkpoints/step_00000002 of a 2-step one-process run."""
    root, out = tmp_path_factory.mktemp("export_runs"), {}
    for kind, extra in KIND.items():
        args = ["train"]
        for item in [*TINY, *extra, f"data.path={small_corpus}", f"train.out_dir={root / kind}"]:
            args += ["--set", item]
        assert main(args) == 0, kind
        out[kind] = root / kind
    return out


def manifest(run: Path) -> dict:
    return json.loads((run / "checkpoints" / "step_00000002" / "manifest.json").read_text())


def global_params(run: Path) -> dict:
    r = Reader(run / "checkpoints")
    try:
        return {n: r.read("param", n, tuple(slice(0, k) for k in s)) for n, s in r.manifest["shapes"].items()}
    finally:
        r.close()


@pytest.mark.parametrize("kind", ["gpt", "llama", "mlp"])
def test_safetensors_round_trip(tmp_path, capsys, runs, kind):
    out = tmp_path / "model.safetensors"
    rc, stdout, err = cli(capsys, "ckpt", "export", runs[kind] / "checkpoints", out, "--format", "safetensors")
    assert (rc, err) == (0, "") and "at step 2 (safetensors)" in stdout
    got = safetensors_numpy.load_file(str(out))
    want = global_params(runs[kind])
    assert sorted(got) == sorted(want)
    for name, arr in want.items():
        assert got[name].dtype == np.float32 and got[name].shape == arr.shape, name
        assert np.array_equal(got[name], arr), name
    from safetensors import safe_open
    with safe_open(str(out), "np") as f:
        meta = f.metadata()
    assert meta["format"] == "hpengine" and meta["config"] == manifest(runs[kind])["config"] and meta["step"] == "2"
    assert not list(tmp_path.glob("*tmp*"))


def test_gpt_qkv_permutation_by_hand():
    H, hd = 3, 4
    C = H * hd
    part = np.arange(3 * C)                  # hpengine column: h*3*hd + j*hd + d
    h, j, d = part // (3 * hd), part % (3 * hd) // hd, part % hd
    code = 100 * h + 10 * j + d              # each column's (head, part, element)
    w = np.tile(code, (C, 1)) + 1000 * np.arange(C)[:, None]      # rows keep their input index
    hw, hb = hf_gpt.qkv_to_hf(w, H), hf_gpt.qkv_to_hf(code, H)
    assert hw.shape == (C, 3 * C) and hb.shape == (3 * C,)
    for jj in range(3):                      # GPT-2: c_attn columns [all q | all k | all v], head-major inside
        for hh in range(H):
            for dd in range(hd):
                col = jj * C + hh * hd + dd
                assert hb[col] == 100 * hh + 10 * jj + dd, (jj, hh, dd)
                assert np.array_equal(hw[:, col], 100 * hh + 10 * jj + dd + 1000 * np.arange(C))
    assert sorted(hb) == sorted(code)        # a permutation, nothing lost or repeated


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_map_names_and_shapes(runs, tied):
    run = runs["gpt_tied" if tied else "gpt"]
    P = {n: a.astype(np.float32) for n, a in global_params(run).items()}
    mcfg = ex._model_config(manifest(run)["config"]).model
    assert mcfg.tie_head == tied
    state = hf_gpt.to_hf(P, mcfg)
    C, V, T, F = mcfg.d_model, mcfg.vocab_size, mcfg.seq_len, mcfg.ffn_mult * mcfg.d_model
    assert ("lm_head.weight" in state) == (not tied)
    assert len(state) == len(P)          # one HF tensor per hpengine tensor
    assert state["transformer.wte.weight"].shape == (V, C) and state["transformer.wpe.weight"].shape == (T, C)
    if not tied:
        assert np.array_equal(state["lm_head.weight"], P["lm_head.w"].T)
    for i in range(mcfg.n_layers):
        q = f"transformer.h.{i}"
        assert state[f"{q}.attn.c_attn.weight"].shape == (C, 3 * C)
        assert np.array_equal(state[f"{q}.attn.c_proj.weight"], P[f"h.{i}.attn.proj.w"])      # Conv1D: (in, out)
        assert state[f"{q}.mlp.c_fc.weight"].shape == (C, F) and state[f"{q}.mlp.c_proj.weight"].shape == (F, C)
        assert np.array_equal(state[f"{q}.attn.c_attn.bias"], hf_gpt.qkv_to_hf(P[f"h.{i}.attn.qkv.b"], mcfg.n_heads))


def test_llama_map_is_rename_and_transpose(runs):
    run = runs["llama"]
    P = global_params(run)
    mcfg = ex._model_config(manifest(run)["config"]).model
    names = hf_llama.names(mcfg)
    assert set(names) == set(P)
    state = hf_llama.to_hf(P, mcfg)
    assert len(state) == len(P)
    for name, (hf, t) in names.items():
        assert t == (P[name].ndim == 2 and name != "wte"), name
        assert np.array_equal(state[hf], P[name].T if t else P[name]), name


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_hf_folder(tmp_path, capsys, runs, kind):
    out = tmp_path / "hf"
    rc, stdout, err = cli(capsys, "ckpt", "export", runs[kind] / "checkpoints" / "step_00000002", out,
                          "--format", "hf")
    assert (rc, err) == (0, ""), err
    assert "byte-level" in stdout        # the small corpus is bytes: no tokenizer files, said so
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    # no max_length: the README's generate(..., max_new_tokens=N) would warn that both are set
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": 0,
                                                                       "pad_token_id": 0}
    conf = json.loads((out / "config.json").read_text())
    assert conf["model_type"] == ("gpt2" if kind == "gpt" else "llama")
    assert conf["vocab_size"] == 256 and conf["eos_token_id"] == 0 and conf["torch_dtype"] == "float32"
    if kind == "gpt":
        assert (conf["n_embd"], conf["n_layer"], conf["n_head"], conf["n_positions"]) == (16, 2, 2, 8)
        assert conf["activation_function"] == "gelu_new"
    else:
        assert (conf["hidden_size"], conf["intermediate_size"], conf["num_key_value_heads"]) == (16, 24, 1)
    state = safetensors_numpy.load_file(str(out / "model.safetensors"))
    P = global_params(runs[kind])
    assert len(state) == len(P)
    assert not list(tmp_path.glob("*tmp*"))


def test_hf_refuses_mlp(tmp_path, capsys, runs):
    out = tmp_path / "hf"
    rc, _, err = cli(capsys, "ckpt", "export", runs["mlp"] / "checkpoints", out, "--format", "hf")
    assert rc == 2 and len(err.splitlines()) == 1
    assert "'mlp' has no Hugging Face equivalent; supported kinds: gpt, llama" in err
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("fmt", ["hdf5", "safetensors", "hf"])
def test_existing_out_refused_without_force(tmp_path, capsys, runs, fmt):
    out = tmp_path / "out"
    out.write_text("keep me")
    rc, _, err = cli(capsys, "ckpt", "export", runs["gpt"] / "checkpoints", out, "--format", fmt)
    assert rc == 2 and err == f"hpengine: error: '{out}' already exists (pass --force to replace it)\n"
    assert out.read_text() == "keep me"
    rc, _, err = cli(capsys, "ckpt", "export", runs["gpt"] / "checkpoints", out, "--format", fmt, "--force")
    assert (rc, err) == (0, "")
    assert out.is_dir() == (fmt == "hf")
    rc, _, err = cli(capsys, "ckpt", "export", runs["gpt"] / "checkpoints", out, "--format", fmt, "--force")
    assert (rc, err) == (0, "")                          # replacing a previous export, file or folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_params_only_hdf5(tmp_path, capsys, runs, small_corpus):
    full, lean = tmp_path / "full.h5", tmp_path / "lean.h5"
    assert cli(capsys, "ckpt", "export", runs["gpt"] / "checkpoints", full)[0] == 0
    rc, _, err = cli(capsys, "ckpt", "export", runs["gpt"] / "checkpoints", lean, "--params-only")
    assert (rc, err) == (0, "")
    with h5py.File(full, "r") as f, h5py.File(lean, "r") as g:
        assert set(f) == {"param", "adam_m", "adam_v"} and set(g) == {"param"}
        assert set(f["param"]) == set(g["param"])
        for n in g["param"]:
            assert np.array_equal(f["param"][n][...], g["param"][n][...]), n
    out = tmp_path / "from-lean"          # checkpoint.init_from reads a params-only export
    args = ["train"]
    for item in [*TINY, *KIND["gpt"], f"data.path={small_corpus}", f"train.out_dir={out}", "train.steps=1",
                 f"checkpoint.init_from={lean}", "checkpoint.every=0"]:
        args += ["--set", item]
    rc, stdout, err = cli(capsys, *args)
    assert rc == 0, err


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_checkpoint_and_export_files_get_the_users_umask(tmp_path, small_corpus, umask):
    """A fresh process under `umask` (as a shell would start it): every file it writes is 0o666 & ~umask,
    the mode `touch` gives, whatever a library's own default (safetensors creates 0600)."""
    def hpengine(*args):
        p = subprocess.run([sys.executable, "-m", "hpengine", *map(str, args)], cwd=tmp_path, text=True,
                           capture_output=True, preexec_fn=lambda: os.umask(umask), timeout=300)
        assert p.returncode == 0, p.stderr
    sets = [a for item in [*TINY, f"data.path={small_corpus}", "train.out_dir=run"] for a in ("--set", item)]
    hpengine("train", *sets)
    for fmt in ex.FORMATS:
        hpengine("ckpt", "export", "run/checkpoints", f"out.{fmt}", "--format", fmt)
    files = [p for d in ("run/checkpoints", "out.hdf5", "out.safetensors", "out.hf")
             for p in ([tmp_path / d] if (tmp_path / d).is_file() else (tmp_path / d).rglob("*")) if p.is_file()]
    assert {"manifest.json", "shard_r00000.h5", "model.safetensors", "out.safetensors"} <= {p.name for p in files}
    want = 0o666 & ~umask
    assert {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in files} == \
        {p.relative_to(tmp_path).as_posix(): oct(want) for p in files}
