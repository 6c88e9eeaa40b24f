"""After training a train.models = 2 job: eval reports every model, generate and `ckpt export --format hf`
take --model I, and a missing or out-of-range --model is one line. The oracle reads the checkpoint's
"m{i}."-prefixed tensors itself and runs the model's training functions."""
from __future__ import annotations

import io
import json
import tomllib

import numpy as np
import pytest

from hpengine.checkpoint import shards as checkpoint
from hpengine.cli.commands import main
from hpengine.config.load import from_dict
from hpengine.data import build_corpus
from hpengine.data.format import TokenFile
from hpengine.apps.generate import KVDecoder, generate, load
from hpengine.models import LOCAL, build_model

T = 16
TINY = ["model.dtype=float64", f"model.seq_len={T}", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "model.kind=llama", "model.n_kv_heads=1", "train.steps=2", "train.global_batch=4", "train.eval_every=0",
        "runtime.backend=numpy", "train.models=2", "train.model_seeds=[3, 8]", "train.model_lrs=[0.01, 0.002]"]


def sets(*items):
    return [a for it in items for a in ("--set", it)]


@pytest.fixture(scope="module")
def run(small_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("two") / "run"
    assert main(["train", *sets(*TINY, f"data.path={small_corpus}", f"train.out_dir={out}")]) == 0
    return out


def model_params(run, i):
    r = checkpoint.Reader(run / "checkpoints")
    cfg = from_dict(tomllib.loads(r.manifest["config"]))
    P = {n[3:]: r.read("param", n, tuple(slice(0, s) for s in shape))
         for n, shape in r.manifest["shapes"].items() if n.startswith(f"m{i}.")}
    r.close()
    return build_model(cfg.model, 1), P


def test_eval_reports_each_model(run, tmp_path, capsys):
    src = tmp_path / "e.txt"
    src.write_text("two models, one file of held-out text to score.\n" * 3)
    data = tmp_path / "e.h5"
    build_corpus([src], data, 256)
    with TokenFile(data) as tf:
        toks = tf.read(0, tf.n_tokens).astype(np.int64)
    want = []
    for i in range(2):
        model, P = model_params(run, i)
        tp, total = LOCAL, 0.0
        for w in range(0, len(toks) - 1, T):
            win = toks[w:w + T + 1]
            h, _ = model.embed_forward(np, P, win[None, :-1], tp)
            for j in range(model.n_layers):
                h, _ = model.layer_forward(np, P, j, h, tp)
            total += float(model.head_forward(np, P, h, win[None, 1:], 1.0, tp)[0])
        want.append(total / (len(toks) - 1))
    assert abs(want[0] - want[1]) > 1e-6             # two different models
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(data), "--json", str(tmp_path / "r.json"), "--batch", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    r = json.loads((tmp_path / "r.json").read_text())
    assert [m["loss"] for m in r["models"]] == pytest.approx(want, rel=1e-12)
    assert r["loss"] == r["models"][0]["loss"]
    assert "model 0: loss" in out and "model 1: loss" in out


def test_generate_picks_the_model(run):
    for i in range(2):
        r = generate(run, "ab", 8, greedy=True, out=io.StringIO(), note=lambda s: None, model_index=i)
        model, P = model_params(run, i)
        ids = list(b"ab") + r["tokens"]
        x, _ = model.embed_forward(np, P, np.array([ids[:-1]]), LOCAL)
        for j in range(model.n_layers):
            x, _ = model.layer_forward(np, P, j, x, LOCAL)
        h = x / np.sqrt((x * x).mean(-1, keepdims=True) + model.eps) * P["norm.w"]
        ref = (h @ P["lm_head.w"])[0, 1:]
        np.testing.assert_allclose(np.stack(r["logits"]), ref, rtol=0, atol=1e-10)
        assert r["tokens"] == [int(t) for t in ref.argmax(-1)]
        _, Pl, _ = load(run, lambda s: None, model_index=i)
        assert KVDecoder(model, Pl).forward(ids[:3]).shape == (3, model.V)


def test_export_hf_picks_the_model(run, tmp_path, capsys):
    from safetensors.numpy import load_file
    capsys.readouterr()
    assert main(["ckpt", "export", str(run / "checkpoints"), str(tmp_path / "hf1"), "--format", "hf",
                 "--model", "1"]) == 0
    _, P = model_params(run, 1)
    st = load_file(str(tmp_path / "hf1" / "model.safetensors"))
    np.testing.assert_array_equal(st["model.embed_tokens.weight"], P["wte"])
    np.testing.assert_array_equal(st["model.layers.1.self_attn.k_proj.weight"], P["h.1.attn.k.w"].T)


@pytest.mark.parametrize("args,msg", [([], "pass --model I, I in 0..1"), (["--model", "2"], "--model 2")])
def test_missing_or_bad_model_is_one_line(run, tmp_path, capsys, args, msg):
    capsys.readouterr()
    assert main(["ckpt", "export", str(run / "checkpoints"), str(tmp_path / "x"), "--format", "hf", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err and not (tmp_path / "x").exists()
    assert main(["generate", str(run), "--prompt", "a", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err
