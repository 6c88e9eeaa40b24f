"""`hpengine eval`: the exact mean NLL of a checkpoint over every token of a file, against an independent
computation (parameters read straight from the checkpoint, the model's block functions run window by
window over our own enumeration, the partial last window included); bits per byte by hand; the final
checkpoint (`checkpoint.at_end`); the one-line errors."""
from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest

from hpengine.checkpoint.write import OWNER     # a checkpoints folder's run marker
from hpengine.checkpoint import shards as checkpoint
from hpengine.cli.commands import main
from hpengine.config.load import from_dict
from hpengine.data import build_corpus
from hpengine.data.format import TokenFile
from hpengine.apps.evaluate import count_bytes, plan_passes
from hpengine.models import LOCAL, build_model

T = 16
TINY = ["model.dtype=float64", f"model.seq_len={T}", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "train.steps=2", "train.global_batch=4", "train.eval_every=0", "runtime.backend=numpy",
        "train.log_every=1"]
TEXT = "evaluate me: every token once, é and 日本 included.\n"     # 3 documents, 50+ tokens, not a multiple of T


def cli(capsys, *args):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def sets(*items):
    return [a for it in items for a in ("--set", it)]


@pytest.fixture(scope="module")
def run(small_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "run"
    assert main(["train", *sets(*TINY, f"data.path={small_corpus}", f"train.out_dir={out}")]) == 0
    return out


@pytest.fixture(scope="module")
def evalfile(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaldata")
    docs = []
    for i, text in enumerate([TEXT, TEXT.upper() * 2, "tail"]):
        (root / f"d{i}.txt").write_text(text, encoding="utf-8")
        docs.append(root / f"d{i}.txt")
    out = root / "e.h5"
    build_corpus(docs, out, 256)
    return out


def oracle(ckpt_dir, path):
    """(sum of NLL, predicted tokens): windows w of T targets stepping by T, the last one shorter."""
    r = checkpoint.Reader(ckpt_dir)
    import tomllib
    cfg = from_dict(tomllib.loads(r.manifest["config"]))
    P = {n: r.read("param", n, tuple(slice(0, s) for s in shape)) for n, shape in r.manifest["shapes"].items()}
    model, tp = build_model(cfg.model, 1), LOCAL
    with TokenFile(path) as tf:
        toks = tf.read(0, tf.n_tokens).astype(np.int64)
    total, n, w = 0.0, 0, 0
    while w * T < len(toks) - 1:
        win = toks[w * T: w * T + T + 1]
        x, y = win[None, :-1], win[None, 1:]
        h, _ = model.embed_forward(np, P, x, tp)
        for i in range(cfg.model.n_layers):
            h, _ = model.layer_forward(np, P, i, h, tp)
        loss, _ = model.head_forward(np, P, h, y, 1.0, tp)
        total += float(loss)
        n += y.size
        w += 1
    r.close()
    return total, n, toks


def test_final_checkpoint_exists_and_ckpt_info_reads_it(run, capsys):
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.name != OWNER) == ["latest", "step_00000002"]
    rc, out, _ = cli(capsys, "ckpt", "info", root)
    assert rc == 0 and "step 2" in out and "checksums: ok" in out


def test_no_final_checkpoint_when_switched_off_or_already_saved(small_corpus, tmp_path):
    off = tmp_path / "off"
    assert main(["train", *sets(*TINY, f"data.path={small_corpus}", f"train.out_dir={off}",
                                "checkpoint.at_end=false", "checkpoint.every_minutes=0")]) == 0
    assert not (off / "checkpoints").exists()
    every = tmp_path / "every"
    assert main(["train", *sets(*TINY, f"data.path={small_corpus}", f"train.out_dir={every}",
                                "checkpoint.every=1")]) == 0
    assert sorted(p.name for p in (every / "checkpoints").iterdir() if p.name != OWNER) == ["latest", "step_00000001",
                                                                         "step_00000002"]


def test_eval_equals_an_independent_computation(run, evalfile, capsys, tmp_path):
    ckpt = run / "checkpoints" / "step_00000002"
    want, n, toks = oracle(ckpt, evalfile)
    assert n == len(toks) - 1 and n % T != 0              # the partial window is there
    for target in (run, run / "checkpoints", ckpt):       # run folder, checkpoints folder, step folder
        for batch in ("1", "3", "8"):
            rc, out, err = cli(capsys, "eval", target, "--data", evalfile, "--json", tmp_path / "e.json",
                               "--batch", batch, "--force")      # each pass replaces the previous figures
            assert rc == 0, err
            r = json.loads((tmp_path / "e.json").read_text())
            assert r["tokens"] == n
            assert r["loss"] == pytest.approx(want / n, rel=1e-12)
            assert r["perplexity"] == pytest.approx(math.exp(want / n), rel=1e-12)
    # bits per byte by hand: bytes = the non-eos predicted tokens (eos 0 of the bytes tokenizer)
    n_bytes = int(np.count_nonzero(toks[1:] != 0))
    assert r["bytes"] == n_bytes == n - 3                   # each of the 3 documents ends with eos
    assert r["bits_per_byte"] == pytest.approx(want / n / math.log(2) * n / n_bytes, rel=1e-12)
    line = out.strip().splitlines()[-1]
    assert r["batches"] == 3 and r["replicas"] == 1 and r["seconds"] > 0    # 8 windows, 2, the partial one
    assert line == (f"eval {ckpt} on {evalfile}: {n:,} tokens, loss {want / n:.6f}, perplexity "
                    f"{math.exp(want / n):.4f}, bits/byte {r['bits_per_byte']:.6f}; 3 batches in "
                    f"{r['seconds']:.1f} s")


def test_plan_passes_covers_every_window_once():
    for n_tokens in (2, 17, 33, 100, 1000):
        for replicas in (1, 2, 3, 4):
            for batch, m in ((1, 1), (3, 1), (4, 2), (6, 3)):
                plans = plan_passes(n_tokens, T, replicas, batch, m)
                assert len({len(p) for p in plans}) == 1          # the same number of passes everywhere
                covered = [(f + j, length) for p in plans for f, c, length, ok in p if ok for j in range(c)]
                assert sum(length for _, length in covered) == n_tokens - 1
                assert sorted(w for w, _ in covered) == list(range(len(covered)))
                assert all(c % m == 0 or c == 1 for p in plans for _, c, _, _ in p)


def test_bytes_of_a_hugging_face_and_a_version1_file(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text(TEXT * 20, encoding="utf-8")
    out = tmp_path / "bpe.h5"
    build_corpus([src], out, 300, train_tokenizer=True)
    from tokenizers import Tokenizer
    with TokenFile(out) as tf:
        tok = Tokenizer.from_str(tf.tokenizer)
        first = tok.decode([int(tf.read(0, 1)[0])])
        assert count_bytes(tf) == len((TEXT * 20).encode()) - len(first.encode())
    v1 = tmp_path / "v1.h5"
    with h5py.File(v1, "w") as h5:
        h5["tokens"] = np.arange(100, dtype=np.uint8)
    with TokenFile(v1) as tf:
        assert count_bytes(tf) is None


def test_bad_inputs_end_with_one_line(run, evalfile, tmp_path, capsys):
    rc, _, err = cli(capsys, "eval", tmp_path / "nowhere", "--data", evalfile)
    assert rc == 2 and err.count("\n") == 1 and "checkpoint.every" in err and "checkpoint.at_end" in err
    v1 = tmp_path / "v1.h5"                 # no tokenizer recorded: not the checkpoint's bytes tokenizer
    with h5py.File(v1, "w") as h5:
        h5["tokens"] = np.arange(100, dtype=np.uint8)
    rc, _, err = cli(capsys, "eval", run, "--data", v1)
    assert rc == 2 and err.count("\n") == 1 and "tokenizer sha256" in err and "none (version 1)" in err
    big = tmp_path / "big.h5"
    with h5py.File(big, "w") as h5:
        h5["tokens"] = np.arange(400, dtype=np.uint16)
    rc, _, err = cli(capsys, "eval", run, "--data", big)
    assert rc == 2 and err.count("\n") == 1 and "model.vocab_size >= 400" in err
    rc, _, err = cli(capsys, "eval", run, "--data", tmp_path / "missing.h5")
    assert rc == 2 and err.count("\n") == 1 and "missing.h5" in err


def test_json_dash_writes_the_json_alone_to_stdout(run, evalfile, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = run / "checkpoints" / "step_00000002"
    want, n, _ = oracle(ckpt, evalfile)
    rc, out, err = cli(capsys, "eval", ckpt, "--data", evalfile, "--json", "-")
    assert rc == 0, err
    r = json.loads(out)                                    # nothing else on stdout
    assert r["tokens"] == n and r["loss"] == pytest.approx(want / n, rel=1e-12)
    assert err.startswith(f"eval {ckpt} on {evalfile}: {n:,} tokens") and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []                  # no file named '-'


@pytest.fixture(scope="module")
def masked_run(small_corpus, tmp_path_factory):
    """A checkpoint trained with data.document_mask = true."""
    out = tmp_path_factory.mktemp("evalmask") / "run"
    assert main(["train", *sets(*TINY, f"data.path={small_corpus}", f"train.out_dir={out}",
                                "data.document_mask=true")]) == 0
    return out


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """Documents of 2 to 40 bytes (eos included), so that windows of T hold several and cut others."""
    root = tmp_path_factory.mktemp("shortdocs")
    texts = ["a", "hi", TEXT[:30], "xyz!", TEXT.upper()[:12], "", "é日", TEXT[:7], "tail"]
    docs = []
    for i, text in enumerate(t for t in texts if t):
        (root / f"d{i}.txt").write_text(text, encoding="utf-8")
        docs.append(root / f"d{i}.txt")
    out = root / "docs.h5"
    build_corpus(docs, out, 256)
    return out


def document_oracle(ckpt_dir, path):
    """(sum of NLL, counted targets, bytes) by hand: in each window of T (stepping by T, the last shorter),
    every document's piece runs alone through the model's forward (positions from 0, nothing else in view),
    scoring its targets inside the same document."""
    import tomllib
    r = checkpoint.Reader(ckpt_dir)
    cfg = from_dict(tomllib.loads(r.manifest["config"]))
    P = {n: r.read("param", n, tuple(slice(0, s) for s in shape)) for n, shape in r.manifest["shapes"].items()}
    r.close()
    model = build_model(cfg.model, 1)
    with TokenFile(path) as tf:
        toks, offs = tf.read(0, tf.n_tokens).astype(np.int64), tf.doc_offsets
    doc = np.searchsorted(offs, np.arange(len(toks)), side="right") - 1
    total, n, n_bytes = 0.0, 0, 0
    for s in range(0, len(toks) - 1, T):
        inputs = np.arange(s, min(s + T, len(toks) - 1))
        for d in np.unique(doc[inputs]):
            i = inputs[(doc[inputs] == d) & (doc[inputs + 1] == d)]    # inputs whose target is in their document
            if i.size == 0:
                continue
            assert np.all(np.diff(i) == 1)
            x, y = toks[i][None, :], toks[i + 1][None, :]
            h, _ = model.embed_forward(np, P, x, LOCAL)
            for layer in range(cfg.model.n_layers):
                h, _ = model.layer_forward(np, P, layer, h, LOCAL)
            loss, _ = model.head_forward(np, P, h, y, 1.0, LOCAL)
            total += float(loss)
            n += y.size
            n_bytes += int(np.count_nonzero(y != 0))           # eos (0) decodes to no byte
    return total, n, n_bytes, toks, offs


def test_eval_of_a_document_masked_checkpoint_equals_its_documents_run_alone(masked_run, short_docs, capsys,
                                                                             tmp_path):
    want, n, n_bytes, toks, offs = document_oracle(masked_run / "checkpoints" / "step_00000002", short_docs)
    assert n == len(toks) - 1 - (len(offs) - 2)             # every token but each document's first
    assert (len(toks) - 1) % T and len(offs) - 1 > (len(toks) - 1) // T    # a partial window; several per window
    for batch in ("1", "3", "8"):
        rc, _, err = cli(capsys, "eval", masked_run, "--data", short_docs, "--json", tmp_path / "e.json",
                         "--batch", batch, "--force")
        assert rc == 0, err
        r = json.loads((tmp_path / "e.json").read_text())
        assert r["tokens"] == n and r["bytes"] == n_bytes
        assert r["loss"] == pytest.approx(want / n, rel=1e-10)
        assert r["perplexity"] == pytest.approx(math.exp(want / n), rel=1e-10)
        assert r["bits_per_byte"] == pytest.approx(want / math.log(2) / n_bytes, rel=1e-10)
    # switched off, the same checkpoint scores the file as one stream: every token but the first counted
    rc, _, err = cli(capsys, "eval", masked_run, "--data", short_docs, "--json", tmp_path / "e.json", "--force",
                     *sets("data.document_mask=false"))
    assert rc == 0, err
    r = json.loads((tmp_path / "e.json").read_text())
    assert r["tokens"] == len(toks) - 1 and r["loss"] != pytest.approx(want / n, rel=1e-6)


def test_a_file_of_one_token_documents_has_nothing_to_score_in_one_line(masked_run, tmp_path, capsys):
    from hpengine.data.format import sha256_text, write_token_file
    raw = tmp_path / "t.raw"
    np.arange(1, 9, dtype=np.uint8).tofile(raw)
    one = tmp_path / "one.h5"
    write_token_file(one, raw, np.uint8, np.arange(9), {"vocab_size": 256, "eos_id": 0, "tokenizer": "bytes",
                                                        "tokenizer_sha256": sha256_text("bytes")})
    rc, _, err = cli(capsys, "eval", masked_run, "--data", one)
    assert rc == 2 and err.count("\n") == 1 and "nothing to score" in err
