"""Unit tests for building token files: inputs, the bytes tokenizer, the built-in corpus, the CLI.
Tokenizers (tokenizer.json, trained BPE, workers): test_data_tokenizer.py; reading: test_dataset.py."""
from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
import sys

import numpy as np
import pytest

from hpengine import data
from hpengine.cli.commands import main
from hpengine.data import DataError, TokenFile, build, build_corpus, builtin, inputs, tokenizer
from hpengine.data.format import sha256_text


def docs_of(path) -> list[bytes]:
    """The documents of a byte-level token file, each without its eos (checked)."""
    with TokenFile(path) as f:
        toks, off = f.read(0, f.n_tokens).tobytes(), f.doc_offsets
        assert f.eos_id == 0 and f.dtype == np.uint8
    docs = [toks[a:b] for a, b in zip(off[:-1], off[1:])]
    assert all(d.endswith(b"\0") and b"\0" not in d[:-1] for d in docs)
    return [d[:-1] for d in docs]


def attrs_of(path) -> dict:
    with TokenFile(path) as f:
        return dict(f.attrs)


def cli(args, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    io_ = capsys.readouterr()
    return code, io_.out, io_.err


def cli_error(args, capsys) -> str:
    code, out, err = cli(args, capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("hpengine: error: ")
    return err


@pytest.fixture
def tree(tmp_path):
    """Text files at three depths and without extensions, next to a binary and a non-UTF-8 file."""
    src = tmp_path / "src"
    (src / "sub" / "deeper").mkdir(parents=True)
    files = {"LICENSE": "Permission is granted\n", "COPYING": "copy me\n", "a.py": "print('alpha')\n",
             "sub/notes": "déjà vu ✓\n", "sub/deeper/z.md": "# zulu\n"}
    for name, text in files.items():
        (src / name).write_text(text, encoding="utf-8")
    (src / "blob.txt").write_bytes(b"bin\0ary")
    (src / "latin1.txt").write_bytes("café".encode("latin-1"))
    (src / "empty.txt").write_bytes(b"")
    return src


ORDER = ["COPYING", "LICENSE", "a.py", "sub/deeper/z.md", "sub/notes"]       # name order, depth first


def texts(src, names=ORDER) -> list[bytes]:
    return [(src / n).read_bytes() for n in names]


# ----------------------------------------------------------------------------- inputs

def test_folder_is_read_recursively_whatever_the_names(tmp_path, tree):
    out = tmp_path / "out" / "c.h5"                      # parent folder does not exist yet
    info = build_corpus([tree], out)
    assert docs_of(out) == texts(tree)
    want_tokens = sum(len(t) + 1 for t in texts(tree))
    assert {k: info[k] for k in ("path", "n_docs", "n_tokens", "n_files", "vocab_size", "eos_id")} == {
        "path": str(out), "n_docs": 5, "n_tokens": want_tokens, "n_files": 6, "vocab_size": 256, "eos_id": 0}
    a = attrs_of(out)
    assert (a["skipped_binary"], a["skipped_undecodable"], a["skipped_empty"], a["n_files"]) == (1, 1, 1, 6)
    assert a["format"] == "hpengine-tokens" and a["version"] == 2 and a["vocab_size"] == 256
    assert a["tokenizer_sha256"] == sha256_text("bytes") and a["source"] == str(tree)
    with TokenFile(out) as f:
        assert f.tokenizer == "bytes"
        assert list(f.doc_offsets) == list(np.cumsum([0] + [len(t) + 1 for t in texts(tree)]))


def test_hidden_folders_and_pycache_are_skipped(tmp_path, tree):
    for d in (".git", "__pycache__", "sub/.cache"):
        (tree / d).mkdir()
        (tree / d / "x.txt").write_text("hidden\n")
    (tree / ".hidden_file").write_text("a hidden file is read\n")
    build_corpus([tree], tmp_path / "c.h5")
    assert docs_of(tmp_path / "c.h5") == [b"a hidden file is read\n"] + texts(tree)


def test_symlinks_are_followed_and_each_real_file_read_once(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "real").mkdir(parents=True)
    (src / "real" / "a.txt").write_text("only once\n")
    (src / "real" / "b.txt").write_text("bee\n")
    (src / "alias.txt").symlink_to(src / "real" / "a.txt")          # a linked file
    (src / "real" / "up").symlink_to(src)                            # a loop back to the top
    other = tmp_path / "other"
    other.mkdir()
    (other / "c.txt").write_text("reached through a link\n")
    (src / "zlink").symlink_to(other)                                # a linked folder
    scanned, scandir = [], os.scandir
    monkeypatch.setattr(os, "scandir", lambda p: scanned.append(os.path.relpath(p, tmp_path)) or scandir(p))
    out = tmp_path / "c.h5"
    info = build_corpus([src, src / "real" / "b.txt", other / "c.txt"], out)
    assert docs_of(out) == [b"only once\n", b"bee\n", b"reached through a link\n"]
    assert info["n_files"] == 3 and scanned == ["src", "src/real", "src/zlink"]     # each folder once


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)])
def test_compressed_files_are_decompressed(tmp_path, suffix, compress):
    src = tmp_path / "src"
    src.mkdir()
    (src / f"a.txt{suffix}").write_bytes(compress("compressed text ✓\n".encode()))
    (src / f"b{suffix}").write_bytes(compress(b"\0\1\2 binary inside"))
    (src / f"c{suffix}").write_bytes(b"not compressed at all")          # damaged: undecodable
    info = build_corpus([src], tmp_path / "c.h5")
    assert docs_of(tmp_path / "c.h5") == ["compressed text ✓\n".encode()]
    assert (info["n_files"], info["skipped_binary"], info["skipped_undecodable"]) == (1, 1, 1)


def jsonl_lines(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


def test_jsonl_records_are_documents_and_bad_ones_counted(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(jsonl_lines({"text": "first ✓"}, {"text": "second", "id": 2}))
    (src / "b.jsonl.gz").write_bytes(gzip.compress(jsonl_lines(
        {"text": "third"}, b"", {"body": "no text"}, b"[1, 2]", b"{broken", {"text": 7}, {"text": ""},
        {"text": "fourth"})))
    out = tmp_path / "c.h5"
    code, stdout, err = cli(["data", "build", src, "--out", out], capsys)
    assert code == 0 and err == ""
    assert docs_of(out) == ["first ✓".encode(), b"second", b"third", b"fourth"]
    first = f"{src / 'b.jsonl.gz'} line 3"
    assert f'skipped 1 empty, 4 records without "text" (first: {first})' in stdout
    a = attrs_of(out)
    assert (a["skipped_records"], a["skipped_empty"], a["n_files"]) == (4, 1, 2)
    info = build_corpus([src], out, text_field="body")
    assert docs_of(out) == [b"no text"] and info["skipped_records"] == 8
    assert info["first_bad_record"] == f"{src / 'a.jsonl'} line 1"


def test_stdin_is_one_document_or_jsonl(tmp_path, monkeypatch):
    def stdin(data: bytes):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    (tmp_path / "f.txt").write_text("a file\n")
    out = tmp_path / "out" / "c.h5"
    stdin(b"from standard input\n")
    build_corpus(["-", tmp_path / "f.txt"], out)
    assert docs_of(out) == [b"from standard input\n", b"a file\n"]
    stdin(jsonl_lines({"text": "r1"}, {"x": 1}, {"text": "r2"}))
    info = build_corpus(["-"], out, jsonl=True)
    assert docs_of(out) == [b"r1", b"r2"] and info["first_bad_record"] == "<stdin> line 2"
    assert sorted(p.name for p in out.parent.iterdir()) == ["c.h5"]        # the spooled copy is gone
    with pytest.raises(DataError, match="twice"):
        build_corpus(["-", "-"], out)


def test_include_and_exclude_globs(tmp_path, tree):
    out = tmp_path / "c.h5"
    build_corpus([tree], out, include=["*.md", "sub/*"])                # name or relative path
    assert docs_of(out) == texts(tree, ["sub/deeper/z.md", "sub/notes"])
    build_corpus([tree], out, exclude=["sub/deeper/*", "LICENSE", "*.txt"])
    assert docs_of(out) == texts(tree, ["COPYING", "a.py", "sub/notes"])
    build_corpus([tree, tree / "LICENSE"], out, include="*.py")        # a named file is always read
    assert docs_of(out) == texts(tree, ["a.py", "LICENSE"])


def test_missing_source_is_named(tmp_path, capsys):
    err = cli_error(["data", "build", tmp_path / "nowhere", "--out", tmp_path / "c.h5"], capsys)
    assert "nowhere" in err and not (tmp_path / "c.h5").exists()


def test_empty_corpus_is_an_error_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"\0\1\2")
    (src / "b.txt").write_bytes(b"\xff\xfe")
    (src / "c.txt").write_bytes(b"")
    err = cli_error(["data", "build", src, "--out", src / "c.h5"], capsys)
    assert str(src) in err and "1 file read, skipped 1 binary, 1 undecodable, 1 empty" in err
    assert sorted(p.name for p in src.iterdir()) == ["a.bin", "b.txt", "c.txt"]
    with pytest.raises(DataError, match="no documents"):
        build_corpus([src], src / "c.h5", include=["nothing*"])


# ----------------------------------------------------------------------------- the build itself

def test_bytes_vocab_size_must_be_256(tmp_path, tree):
    build_corpus([tree], tmp_path / "c.h5", 256)
    for bad in (128, 1000):
        with pytest.raises(DataError, match=f"--vocab-size {bad} only applies with --train-tokenizer"):
            build_corpus([tree], tmp_path / "d.h5", bad)
    assert not (tmp_path / "d.h5").exists()


def test_build_is_deterministic_and_overwrites_atomically(tmp_path, tree):
    out_dir = tmp_path / "out"
    build_corpus([tree], out_dir / "one.h5")
    build_corpus([tree], out_dir / "one.h5")
    build_corpus([tree], out_dir / "two.h5")
    assert sorted(p.name for p in out_dir.iterdir()) == ["one.h5", "two.h5"]
    assert (out_dir / "one.h5").read_bytes() == (out_dir / "two.h5").read_bytes()


def test_batches_split_by_count_and_size(monkeypatch):
    monkeypatch.setattr(build, "_BATCH_DOCS", 3)
    monkeypatch.setattr(build, "_BATCH_CHARS", 10)
    monkeypatch.setattr(build, "_PIECE_CHARS", 4)
    docs = ["a", "b", "c", "d", "x" * 12, "e", "y" * 9, "f", "l1\nl2\nl3\n"]
    batches = list(build._batches(docs, cut=True))
    assert [[len(t) for t in texts] for texts, _ in batches] == [[1, 1, 1], [1, 12], [1, 9], [1, 6, 3]]
    assert batches[-1] == (["f", "l1\nl2\n", "l3\n"], [True, False, True])
    assert [len(t) for t, _ in build._batches(docs, cut=False)][-1] == 2      # uncut: "f" and the lines


def test_long_documents_are_cut_at_line_starts(tmp_path, monkeypatch):
    text = "".join(f"line {i}\n" + "  indented\n" * (i % 3) for i in range(300))
    pieces = tokenizer.cut_at_lines(text, 100)
    assert "".join(pieces) == text and len(pieces) > 10
    assert all(len(p) >= 100 and p.endswith("\n") for p in pieces[:-1])
    assert all(p.startswith("line") for p in pieces)
    assert tokenizer.cut_at_lines("no line start " * 50, 10) == ["no line start " * 50]
    (tmp_path / "long.txt").write_text(text)
    (tmp_path / "short.txt").write_text("short\n")
    monkeypatch.setattr(build, "_PIECE_CHARS", 100)
    monkeypatch.setattr(build, "_BATCH_DOCS", 3)                  # pieces of one document in several batches
    info = build_corpus([tmp_path / "long.txt", tmp_path / "short.txt", tmp_path / "long.txt"], tmp_path / "c.h5")
    assert docs_of(tmp_path / "c.h5") == [text.encode(), b"short\n"] and info["n_docs"] == 2


@pytest.mark.parametrize("train", [False, True])
def test_interrupted_build_leaves_nothing(tmp_path, tree, monkeypatch, train):
    real = inputs.documents

    def interrupted(*args, **kwargs):
        for i, doc in enumerate(real(*args, **kwargs)):
            if i == 3:
                raise KeyboardInterrupt
            yield doc
    monkeypatch.setattr(build, "_BATCH_DOCS", 1)
    if train:                         # the training pass completes; the tokenizing pass is interrupted
        monkeypatch.setattr(build, "_encode_all", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    else:
        monkeypatch.setattr(inputs, "documents", interrupted)
    out = tmp_path / "out" / "c.h5"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"stdin text")))
    with pytest.raises(KeyboardInterrupt):
        build_corpus([tree, "-"], out, 300 if train else None, train_tokenizer=train)
    assert list(out.parent.iterdir()) == []


# ----------------------------------------------------------------------------- CLI

def test_cli_build_summary_and_info(tmp_path, tree, capsys):
    out = tmp_path / "c.h5"
    code, stdout, err = cli(["data", "build", tree, "--out", out], capsys)
    n = sum(len(t) + 1 for t in texts(tree))
    assert code == 0 and err == ""
    assert stdout.startswith(f"wrote {out}: {n:,} tokens in 5 documents (vocab 256, eos 0, tokenizer bytes "
                             f"sha256 {sha256_text('bytes')[:8]}...) from 6 files; skipped 1 binary, "
                             "1 undecodable, 1 empty in ")
    assert stdout.endswith(" s\n") and len(stdout.splitlines()) == 1
    code, stdout, err = cli(["data", "info", out], capsys)
    assert code == 0 and err == ""
    for part in (f"{n:,} tokens (uint8) in 5 documents", "vocab 256, eos 0, tokenizer bytes",
                 sha256_text("bytes"), f"source: {tree}", "built from 6 files"):
        assert part in stdout
    assert "not an HDF5" in cli_error(["data", "info", tree / "LICENSE"], capsys)


def test_info_of_a_large_file_reads_only_the_ends_of_its_document_offsets(tmp_path, capsys):
    """`data info` takes no longer on a corpus of millions of documents: the offsets are read when used."""
    import h5py
    n_docs, n = 2_000_000, 4_000_000
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", shape=(n,), dtype=np.uint8)
        f.create_dataset("doc_offsets", data=np.arange(0, n + 1, 2, dtype=np.int64))
        f.attrs.update(format="hpengine-tokens", version=2, vocab_size=256, eos_id=0, tokenizer="bytes",
                       tokenizer_sha256=sha256_text("bytes"), n_docs=n_docs, n_tokens=n, source="test")
    with TokenFile(path) as f:
        assert f.n_docs == n_docs and f._offsets is None          # nothing but the two ends read yet
        assert f.doc_offsets[1] == 2 and len(f.doc_offsets) == n_docs + 1
    code, stdout, err = cli(["data", "info", path], capsys)
    assert code == 0 and f"{n:,} tokens (uint8) in {n_docs:,} documents" in stdout
    with h5py.File(path, "r+") as f:
        f["doc_offsets"][-1] = n - 1                               # the ends are still checked on opening
    with pytest.raises(DataError, match=f"doc_offsets run from 0 to {n - 1}, expected 0 to the {n} tokens"):
        TokenFile(path)


@pytest.mark.parametrize("args, words", [
    (["--vocab-size", "300"], "--vocab-size 300 only applies with --train-tokenizer"),
    (["--train-tokenizer"], "--train-tokenizer needs --vocab-size"),
    (["--train-tokenizer", "--vocab-size", "100"], "--vocab-size 100 is too small"),
    (["--train-tokenizer", "--vocab-size", "300", "--tokenizer", "x.json"], "exclude each other"),
    (["--tokenizer-sample", "0.5"], "--tokenizer-sample 0.5 only applies with --train-tokenizer"),
    (["--train-tokenizer", "--vocab-size", "300", "--tokenizer-sample", "1.5"], "--tokenizer-sample 1.5 is invalid"),
    (["--workers", "0"], "--workers 0 is invalid"),
    (["--eos-token", "</s>"], "does not apply to the bytes tokenizer"),
    (["--text-field", ""], "--text-field '' is invalid"),
])
def test_cli_rejects_inconsistent_flags(tmp_path, tree, capsys, args, words):
    err = cli_error(["data", "build", tree, "--out", tmp_path / "c.h5", *args], capsys)
    assert words in err and not (tmp_path / "c.h5").exists()


def test_cli_without_paths_builds_the_builtin_corpus(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(builtin, "stdlib_files", lambda max_bytes: builtin.walk(
        os.path.dirname(json.__file__), include=["*.py"]))
    code, stdout, _ = cli(["data", "build", "--out", tmp_path / "c.h5"], capsys)
    assert code == 0 and "stdlib" in attrs_of(tmp_path / "c.h5")["source"]
    assert any(b"import " in d for d in docs_of(tmp_path / "c.h5"))


# ----------------------------------------------------------------------------- built-in corpus

def test_default_corpus_path_honours_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HPENGINE_CACHE", str(tmp_path))
    path = data.default_corpus_path()
    assert path.parent == tmp_path and path.name == f"stdlib-3.{sys.version_info.minor}.v2.h5"


def test_default_corpus_builds_from_stdlib_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("HPENGINE_CACHE", str(tmp_path / "cache"))
    path = data.ensure_default_corpus(max_bytes=200_000)
    assert path == data.default_corpus_path() and path.is_file()
    a = attrs_of(path)
    assert 1 < a["n_files"] < 200 and 180_000 <= a["n_tokens"] < 200_000 + 2**20 and "stdlib" in a["source"]
    assert a["n_docs"] == a["n_files"] - a["skipped_empty"] and any(b"def " in d for d in docs_of(path))
    mtime = path.stat().st_mtime_ns
    assert data.ensure_default_corpus(max_bytes=200_000) == path and path.stat().st_mtime_ns == mtime


def test_stdlib_selection_skips_tests_and_site_packages():
    files = builtin.stdlib_files(max_bytes=2**40)
    parts = {part for f in files for part in f.parts}
    assert files and not parts & {"test", "tests", "idle_test", "site-packages"}
    assert all(f.suffix == ".py" for f in files)


def test_build_refuses_an_existing_out_unless_forced(tmp_path, tree, capsys):
    out = tmp_path / "c.h5"
    out.write_bytes(b"someone's file")
    err = cli_error(["data", "build", tree, "--out", out], capsys)
    assert err == f"hpengine: error: --out '{out}' already exists (pass --force to replace it)\n"
    assert out.read_bytes() == b"someone's file"
    code, stdout, err = cli(["data", "build", tree, "--out", out, "--force"], capsys)
    assert code == 0 and err == ""
    assert docs_of(out) == texts(tree)
