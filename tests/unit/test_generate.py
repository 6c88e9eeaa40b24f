"""`hpengine generate`: the kv-cached decode against full forwards through the models' own layer functions,
cache on/off equality, the sampling rules and the one-line errors."""
from __future__ import annotations

import io

import numpy as np
import pytest

from hpengine.cli.commands import main
from hpengine.apps.generate import full_logits, generate, load, sample

T = 48
COMMON = ["model.dtype=float64", f"model.seq_len={T}", "model.d_model=16", "model.n_layers=2", "train.steps=2",
          "train.global_batch=4", "train.eval_every=0", "runtime.backend=numpy", "train.log_every=1"]
KINDS = {"gpt": ["model.kind=gpt", "model.n_heads=2"],
         "llama": ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2"],
         "mlp": ["model.kind=mlp"],
         "llama_qk_norm": ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.qk_norm=true"],
         "llama_head_dim": ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=6",
                            "model.qk_norm=true"],
         "llama_moe": ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.moe.num_experts=4",
                       "model.moe.top_k=2", "model.moe.expert_hidden=8", "model.moe.shared_hidden=4",
                       "model.moe.dense_layers=1"],
         "deepseek": ["model.kind=deepseek", "model.n_heads=4", "model.mla.q_lora_rank=6", "model.mla.kv_lora_rank=8",
                      "model.mla.qk_nope_head_dim=4", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=3",
                      "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4.0",
                      "model.rope_scaling.original_max_position_embeddings=16", "model.moe.num_experts=4",
                      "model.moe.top_k=2", "model.moe.expert_hidden=8", "model.moe.shared_hidden=4",
                      "model.moe.dense_layers=1", "model.moe.router=sigmoid", "model.moe.n_groups=2"]}


def sets(*items):
    return [a for it in items for a in ("--set", it)]


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    out = {}
    for kind, extra in KINDS.items():
        d = root / kind
        assert main(["train", *sets(*COMMON, *extra, f"data.path={small_corpus}", f"train.out_dir={d}")]) == 0
        out[kind] = d
    return out


def quiet(*_):
    pass


@pytest.mark.parametrize("kind", list(KINDS))
def test_cached_logits_equal_full_forward(runs, kind):
    r = generate(runs[kind], "The ", 32, greedy=True, out=io.StringIO(), note=quiet)
    assert len(r["tokens"]) + r["prompt_tokens"] <= T
    model, P, _ = load(runs[kind], quiet)
    ids = list(b"The ") + r["tokens"]
    ref = full_logits(model, P, ids[:-1])          # position j predicts token j + 1
    got = np.stack(r["logits"])
    assert got.shape == (len(r["tokens"]), model.V)
    np.testing.assert_allclose(got, ref[r["prompt_tokens"] - 1:], rtol=0, atol=1e-10)
    # the reference through the model's own embed/layer functions, head logits computed by hand
    from hpengine.models import LOCAL
    tp = LOCAL
    x, _ = model.embed_forward(np, P, np.array([ids[:-1]]), tp)
    for i in range(model.n_layers):
        x, _ = model.layer_forward(np, P, i, x, tp)
    if kind.startswith(("llama", "deepseek")):
        h = x / np.sqrt((x * x).mean(-1, keepdims=True) + model.eps) * P["norm.w"]
    else:
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        h = (x - mu) / np.sqrt(var + 1e-5) * P["ln_f.w"] + P["ln_f.b"]
    w = P["wte"].T if model.tied else P["lm_head.w"]
    np.testing.assert_allclose(got, (h @ w)[0, r["prompt_tokens"] - 1:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_same_with_and_without_cache(runs, kind):
    a = generate(runs[kind], "ab", 32, greedy=True, out=io.StringIO(), note=quiet)
    b = generate(runs[kind], "ab", 32, greedy=True, cache=False, out=io.StringIO(), note=quiet)
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 32
    c = generate(runs[kind], "ab", 32, seed=3, out=io.StringIO(), note=quiet)
    d = generate(runs[kind], "ab", 32, seed=3, cache=False, out=io.StringIO(), note=quiet)
    assert c["tokens"] == d["tokens"]


def test_sampling_rules(runs):
    a = generate(runs["gpt"], "x", 20, seed=7, out=io.StringIO(), note=quiet)
    b = generate(runs["gpt"], "x", 20, seed=7, out=io.StringIO(), note=quiet)
    assert a["tokens"] == b["tokens"]
    g = generate(runs["gpt"], "x", 20, greedy=True, out=io.StringIO(), note=quiet)
    k1 = generate(runs["gpt"], "x", 20, top_k=1, seed=5, out=io.StringIO(), note=quiet)
    p0 = generate(runs["gpt"], "x", 20, top_p=1e-9, seed=5, out=io.StringIO(), note=quiet)
    assert g["tokens"] == k1["tokens"] == p0["tokens"]
    rng = np.random.Generator(np.random.PCG64(0))
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert {sample(z, rng, top_p=0.75) for _ in range(200)} == {0, 1}       # 0.5 + 0.3 >= 0.75
    assert {sample(z, rng, top_k=3) for _ in range(400)} == {0, 1, 2}
    assert {sample(z, rng, top_p=0.5) for _ in range(50)} == {0}


def test_empty_prompt_starts_from_eos(runs):
    r = generate(runs["mlp"], "", 5, greedy=True, out=io.StringIO(), note=quiet)
    assert r["prompt_tokens"] == 1 and len(r["tokens"]) >= 1


def test_stops_at_seq_len(runs):
    notes = []
    r = generate(runs["llama"], "abc", 500, greedy=True, out=io.StringIO(), note=notes.append)
    assert r["prompt_tokens"] + len(r["tokens"]) <= T
    if r["prompt_tokens"] + len(r["tokens"]) == T:
        assert any("seq_len" in n for n in notes)


def test_cli(runs, capsys):
    capsys.readouterr()
    assert main(["generate", str(runs["gpt"]), "--prompt", "hello", "--max-new-tokens", "10", "--top-k", "5",
                 "--temperature", "0.8"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() != "" or "0 tokens" not in err
    assert "tokens/s" in err and "kv cache on" in err
    # the text on stdout is the decoded tokens
    r = generate(runs["gpt"], "hello", 10, temperature=0.8, top_k=5, out=io.StringIO(), note=quiet)
    assert out == bytes(t for t in r["tokens"] if t != 0).decode("utf-8", errors="replace") + "\n"
    ckpt = sorted((runs["gpt"] / "checkpoints").glob("step_*"))[-1]
    assert main(["generate", str(ckpt), "--greedy", "--max-new-tokens", "3", "--no-cache"]) == 0
    assert "kv cache off" in capsys.readouterr().err


@pytest.mark.parametrize("args,msg", [(["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"),
                                      (["--temperature", "0"], "--temperature")])
def test_bad_sampling_refused(runs, capsys, args, msg):
    capsys.readouterr()
    assert main(["generate", str(runs["gpt"]), *args]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and msg in err and out == ""


def test_no_checkpoint_refused(tmp_path, capsys):
    capsys.readouterr()
    assert main(["generate", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint.at_end = true" in err and "checkpoint.every" in err


def test_hugging_face_tokenizer_run(small_corpus, tmp_path, capsys):
    """A run on a trained BPE: the prompt is encoded and the output decoded with the run's tokenizer.json."""
    from tokenizers import Tokenizer

    from hpengine.data import build_corpus
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"d{i}.txt").write_text("the engine trains the model; the model learns the text.\n" * (20 + i))
    info = build_corpus([src], tmp_path / "tok.h5", 300, train_tokenizer=True)
    run = tmp_path / "run"
    assert main(["train", *sets(*COMMON, *KINDS["llama"], f"data.path={tmp_path / 'tok.h5'}", "model.vocab_size=300",
                                f"train.out_dir={run}")]) == 0
    tok = Tokenizer.from_file(info["tokenizer_path"])
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "the engine", "--greedy", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    r = generate(run, "the engine", 12, greedy=True, out=io.StringIO(), note=quiet)
    ids = [t for t in r["tokens"] if t != info["eos_id"]]
    assert r["prompt_tokens"] == len(tok.encode("the engine", add_special_tokens=False).ids)
    assert out == tok.decode(ids) + "\n"


def test_moe_router_biases_reach_generation(small_corpus, tmp_path):
    """A run trained with a capacity and router biases: generation routes with the biases the checkpoint stores
    (dropless, as evaluation), and the cached decode still equals the full forward."""
    import json

    from hpengine.checkpoint.locate import find_checkpoint
    routing = ["model.moe.capacity_factor=1.0", "model.moe.bias_update_rate=0.05", "train.steps=3"]
    assert main(["train", *sets(*COMMON, *KINDS["llama_moe"], *routing, f"data.path={small_corpus}",
                                f"train.out_dir={tmp_path}")]) == 0
    r = find_checkpoint(tmp_path)
    saved = np.array(json.loads((r.dir / "manifest.json").read_text())["state"]["router_bias"][0])
    r.close()
    assert np.abs(saved).sum() > 0
    model, P, _ = load(tmp_path, quiet)
    np.testing.assert_array_equal(model.moe.bias["h.1"], saved[1])
    g = generate(tmp_path, "The ", 16, greedy=True, out=io.StringIO(), note=quiet)
    ids = list(b"The ") + g["tokens"]
    np.testing.assert_allclose(np.stack(g["logits"]), full_logits(model, P, ids[:-1])[g["prompt_tokens"] - 1:],
                               rtol=0, atol=1e-10)


def packed_logits(model, P, junk, ids):
    """Logits (len(ids), V) of ids run as the second document of a packed row (junk first): block-causal
    attention and positions restarting at 0, through the training forward's document path."""
    from hpengine.data.batch import Batch
    from hpengine.models import LOCAL
    from hpengine.models.context import with_documents
    row = np.array([list(junk) + list(ids)], dtype=np.int64)
    seg = np.array([[0] * len(junk) + [1] * len(ids)], dtype=np.int64)
    pos = np.array([list(range(len(junk))) + list(range(len(ids)))], dtype=np.int64)
    ctx = with_documents(LOCAL, Batch(row, segments=seg, positions=pos))
    x, _ = model.embed_forward(np, P, row, ctx)
    for i in range(model.n_layers):
        x, _ = model.layer_forward(np, P, i, x, ctx)
    return model.head_logits(np, P, x)[0, len(junk):]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_document_masked_checkpoint_generates_the_prompt_as_one_document(small_corpus, tmp_path, kind):
    """A checkpoint trained with data.document_mask = true: the cached greedy decode picks the tokens that
    repeated full forwards pick when the prompt and what follows is one document packed behind another."""
    assert main(["train", *sets(*COMMON, *KINDS[kind], "data.document_mask=true", f"data.path={small_corpus}",
                                f"train.out_dir={tmp_path}")]) == 0
    g = generate(tmp_path, "The ", 20, greedy=True, out=io.StringIO(), note=quiet)
    model, P, _ = load(tmp_path, quiet)
    junk = list(b"an unrelated document.\n")
    ids = list(b"The ")
    for got in g["tokens"]:
        logits = packed_logits(model, P, junk, ids)
        assert got == int(np.argmax(logits[-1]))
        ids.append(got)
    assert len(g["tokens"]) == 20
    np.testing.assert_allclose(np.stack(g["logits"]), packed_logits(model, P, junk, ids[:-1])[3:], rtol=0,
                               atol=1e-10)
    # the junk document is really in the row: without the documents the logits differ
    row = junk + ids[:-1]
    assert not np.allclose(full_logits(model, P, row)[len(junk) + 3:], np.stack(g["logits"]), atol=1e-6)
