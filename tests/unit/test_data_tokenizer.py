"""Unit tests for the tokenizers of a build: a trained byte-level BPE, tokenizer.json files of every model
kind, eos resolution, the token dtype, worker processes, bad tokenizer files. Tokenizers are made here
with Hugging Face tokenizers' own API: no network."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hpengine.cli.commands import main
from hpengine.data import DataError, TokenFile, build, build_corpus, token_dtype
from hpengine.data import tokenizer as toks
from hpengine.data.format import sha256_text

WORDS = ("the rank sends a buffer to its neighbour and waits for the reply while the gradient of each layer "
         "flows back through the pipeline — déjà vu ✓ 𝛑").split()


def write_corpus(folder, n_docs=60, seed=0) -> list[str]:
    """Deterministic documents with newlines, tabs, repeated spaces and non-ASCII text, one per file."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(n_docs):
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), size=int(rng.integers(3, 40)))]
        seps = rng.choice([" ", "  ", "\n", "\t", ", ", "  \n", "\r\n", " \n\n"], size=len(words))
        text = "".join(w + s for w, s in zip(words, seps))
        (folder / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
        docs.append(text)
    return docs


def token_docs(path) -> tuple[list[list[int]], TokenFile]:
    """The documents of a token file as id lists, each without its eos (checked to end each one)."""
    with TokenFile(path) as f:
        ids, off = f.read(0, f.n_tokens).astype(np.int64), f.doc_offsets
    docs = [ids[a:b] for a, b in zip(off[:-1], off[1:])]
    assert all(d[-1] == f.eos_id and f.eos_id not in d[:-1] for d in docs)
    return [d[:-1].tolist() for d in docs], f


def cli(args, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    io_ = capsys.readouterr()
    return code, io_.out, io_.err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return root / "src", write_corpus(root / "src")


def wordpiece(special=("[UNK]", "[SEP]")) -> Tokenizer:
    vocab = {t: i for i, t in enumerate([*special, *sorted(set("".join(WORDS))), *sorted(set(WORDS))])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(list(special))
    return tok


def unigram(docs) -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(docs, trainers.UnigramTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"],
                                                          unk_token="<unk>", show_progress=False))
    return tok


# ----------------------------------------------------------------------------- trained BPE

def test_trained_bpe_round_trips_through_the_cli(tmp_path, corpus, capsys, monkeypatch):
    src, docs = corpus
    monkeypatch.setattr(build, "_PIECE_CHARS", 50)               # long documents go in pieces
    out = tmp_path / "bpe.h5"
    code, stdout, err = cli(["data", "build", src, "--out", out, "--train-tokenizer", "--vocab-size", "320"], capsys)
    saved = tmp_path / "bpe.tokenizer.json"
    assert code == 0 and err == "" and f"tokenizer saved to {saved}" in stdout and "tokenizer BPE" in stdout
    ids, f = token_docs(out)
    trained = Tokenizer.from_file(str(saved))
    assert f.tokenizer == saved.read_text() and f.tokenizer_sha256 == sha256_text(f.tokenizer)
    assert f.eos_id == trained.token_to_id("<|endoftext|>") and 257 <= f.vocab_size <= 320
    assert f.dtype == np.uint16 and f.attrs["n_docs"] == len(docs)
    decoder = Tokenizer.from_str(f.tokenizer)                       # the file alone is enough to decode
    assert [decoder.decode(d, skip_special_tokens=False) for d in ids] == docs
    assert sum(map(len, ids)) < sum(len(d.encode()) for d in docs)    # merges were learned
    again = tmp_path / "again.h5"                                     # the saved tokenizer, used as a file
    code, stdout, _ = cli(["data", "build", src, "--out", again, "--tokenizer", saved], capsys)
    assert code == 0 and "tokenizer saved" not in stdout
    assert token_docs(again)[0] == ids
    assert ids == [trained.encode(d, add_special_tokens=False).ids for d in docs]   # pieces change nothing


def test_tokenizer_sample_and_out(tmp_path, corpus):
    src, _ = corpus
    for i, how in enumerate((0.25, 10, "0.5", "7")):
        where = tmp_path / "sub" / f"t{i}.json"
        info = build_corpus([src], tmp_path / f"s{i}.h5", 300, train_tokenizer=True, tokenizer_sample=how,
                            tokenizer_out=where)
        assert info["tokenizer_path"] == str(where) and where.is_file() and info["n_docs"] == 60
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s0.h5", "s1.h5", "s2.h5", "s3.h5", "sub"]


def test_sample_is_deterministic():
    docs = [str(i) for i in range(1000)]
    half = list(toks.sample(iter(docs), 0.5))
    assert half == list(toks.sample(iter(docs), 0.5)) and 480 <= len(half) <= 520
    some = list(toks.sample(iter(docs), 25))
    assert some == list(toks.sample(iter(docs), 25)) and len(set(some)) == 25 and max(map(int, some)) > 500
    assert list(toks.sample(iter(docs[:5]), 25)) == docs[:5] and list(toks.sample(iter(docs), None)) == docs


def test_special_token_text_inside_a_document_is_text(tmp_path):
    src = tmp_path / "src"
    write_corpus(src, n_docs=20)
    (src / "z.txt").write_text("a literal <|endoftext|> in the text")
    out = tmp_path / "c.h5"
    build_corpus([src], out, 300, train_tokenizer=True)
    ids, f = token_docs(out)                                         # eos only at the ends (checked)
    assert Tokenizer.from_str(f.tokenizer).decode(ids[-1], skip_special_tokens=False) == \
        "a literal <|endoftext|> in the text"


# ----------------------------------------------------------------------------- tokenizer.json files

def test_wordpiece_and_unigram_files_are_accepted(tmp_path, corpus, capsys, monkeypatch):
    src, docs = corpus
    monkeypatch.setattr(build, "_PIECE_CHARS", 40)               # long documents go in pieces where exact
    for name, tok, eos in (("wp", wordpiece(), "[SEP]"), ("uni", unigram(docs), "</s>")):
        path = tmp_path / f"{name}.json"
        tok.save(str(path))
        out = tmp_path / f"{name}.h5"
        code, stdout, err = cli(["data", "build", src, "--out", out, "--tokenizer", path], capsys)
        assert code == 0 and err == "", err
        ids, f = token_docs(out)
        # the WordPiece vocabulary has gaps (a word that is also a character keeps its last id): the
        # file's vocab covers the largest id, more than get_vocab_size counts
        top = max(tok.get_vocab(with_added_tokens=True).values())
        assert f.eos_id == tok.token_to_id(eos) and f.vocab_size == max(top + 1, tok.get_vocab_size(True))
        assert f.attrs["n_docs"] == len(docs) and f.dtype == np.uint8
        assert ids == [tok.encode(d, add_special_tokens=False).ids for d in docs]     # as whole documents
        assert toks.load(path).line_cuts == (name == "wp")        # Metaspace prefixes every piece with "▁"
        kind = json.loads(f.tokenizer)["model"]["type"]
        assert kind in ("WordPiece", "Unigram") and f"tokenizer {kind}" in stdout


def test_eos_resolution_and_eos_token(tmp_path, corpus, capsys):
    src, _ = corpus
    tok = wordpiece(("[UNK]", "[SEP]", "</s>", "<|endoftext|>"))
    path = tmp_path / "t.json"
    tok.save(str(path))
    assert toks.load(path).eos_id == tok.token_to_id("<|endoftext|>")           # the first candidate
    assert toks.load(path, "</s>").eos_id == tok.token_to_id("</s>")
    assert toks.load(path, "the").eos_id == tok.token_to_id("the")                # any token will do
    err = cli(["data", "build", src, "--out", tmp_path / "c.h5", "--tokenizer", path, "--eos-token", "<nope>"],
              capsys)[2]
    assert "'<nope>' is not a token" in err and "</s>" in err and len(err.splitlines()) == 1
    wordpiece(("[UNK]",)).save(str(path))
    code, _, err = cli(["data", "build", src, "--out", tmp_path / "c.h5", "--tokenizer", path], capsys)
    assert code == 2 and "pass --eos-token" in err and str(path) in err
    code, _, err = cli(["data", "build", src, "--out", tmp_path / "c.h5", "--tokenizer", path,
                        "--eos-token", "[UNK]"], capsys)
    assert code == 0 and err == ""


def test_token_dtype_by_vocab_size():
    assert [token_dtype(v) for v in (1, 256, 257, 65_536, 65_537, 200_000)] == \
        [np.uint8, np.uint8, np.uint16, np.uint16, np.uint32, np.uint32]
    with pytest.raises(DataError, match="vocab_size = 0 is invalid"):
        token_dtype(0)


@pytest.mark.parametrize("content, words", [
    ("{not json", "is not valid JSON"),
    ('{"version": "1.0"}', "is not a Hugging Face tokenizer"),
    ("[1, 2, 3]", "is not a Hugging Face tokenizer"),
    (None, "cannot be read (no such file)"),
])
def test_bad_tokenizer_file_is_one_line_and_writes_nothing(tmp_path, corpus, capsys, content, words):
    src, _ = corpus
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    out_dir = tmp_path / "out"
    code, stdout, err = cli(["data", "build", src, "--out", out_dir / "c.h5", "--tokenizer", path], capsys)
    assert code == 2 and stdout == "" and len(err.splitlines()) == 1
    assert err.startswith(f"hpengine: error: tokenizer '{path}' ") and words in err
    assert not out_dir.exists() or list(out_dir.iterdir()) == []


# ----------------------------------------------------------------------------- worker processes

def test_workers_give_identical_files(tmp_path, corpus, monkeypatch):
    src, _ = corpus
    tok_path = tmp_path / "t.json"
    build_corpus([src], tmp_path / "first.h5", 300, train_tokenizer=True, tokenizer_out=tok_path)
    monkeypatch.setattr(build, "_BATCH_DOCS", 7)                      # many batches, several in flight
    build_corpus([src], tmp_path / "w1.h5", tokenizer=tok_path, workers=1)
    build_corpus([src], tmp_path / "w2.h5", tokenizer=tok_path, workers=2)
    assert (tmp_path / "w1.h5").read_bytes() == (tmp_path / "w2.h5").read_bytes()
    assert token_docs(tmp_path / "w2.h5")[0] == token_docs(tmp_path / "first.h5")[0]


def test_interrupted_worker_build_leaves_nothing(tmp_path, corpus, monkeypatch):
    src, _ = corpus
    tok_path = tmp_path / "t.json"
    unigram(corpus[1]).save(str(tok_path))
    real = build.inputs.documents

    def interrupted(*args, **kwargs):
        for i, doc in enumerate(real(*args, **kwargs)):
            if i == 30:
                raise KeyboardInterrupt
            yield doc
    monkeypatch.setattr(build.inputs, "documents", interrupted)
    monkeypatch.setattr(build, "_BATCH_DOCS", 4)
    out_dir = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        build_corpus([src], out_dir / "c.h5", tokenizer=tok_path, workers=2)
    assert list(out_dir.iterdir()) == []
