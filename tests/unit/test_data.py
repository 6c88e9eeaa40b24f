"""Unit tests for hpengine.data: corpus building, token-file validation, the global-batch sampler."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from hpengine import data
from hpengine.data import builtin
from hpengine.data import DataError, TokenDataset, build_corpus


@pytest.fixture
def text_tree(tmp_path):
    """A folder with text files at two depths, a binary file and a non-text suffix, plus a loose file."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_bytes(b"bravo " * 50)
    (src / "a.py").write_bytes(b"print('alpha')\n" * 20)
    (src / "sub" / "c.md").write_bytes(b"# charlie\n" * 30)
    (src / "blob.txt").write_bytes(b"bin\0ary")      # text suffix but NUL bytes: skipped
    (src / "image.png").write_bytes(b"not text")     # not a text suffix: skipped
    loose = tmp_path / "loose.dat"                    # named explicitly: taken whatever its suffix
    loose.write_bytes("délta\n".encode() * 40)
    return src, loose


def expected_bytes(src, loose):
    parts = [(src / "a.py"), (src / "b.txt"), (src / "sub" / "c.md"), loose]
    return b"\n\n".join(p.read_bytes() for p in parts)


@pytest.fixture
def corpus(tmp_path):
    """A 20k-token file of varied bytes, enough for any split at small seq_len."""
    rng = np.random.default_rng(0)
    path = tmp_path / "tokens.h5"
    with h5py.File(path, "w") as h5:
        h5["tokens"] = rng.integers(0, 256, size=20_000, dtype=np.uint8)
        h5.attrs["vocab_size"] = 256
    return path


def write_h5(path, **datasets):
    with h5py.File(path, "w") as h5:
        for name, value in datasets.items():
            h5[name] = value
    return path


# ----------------------------------------------------------------------------- building

def test_build_from_folder_and_file_round_trips(tmp_path, text_tree):
    src, loose = text_tree
    out = tmp_path / "out" / "corpus.h5"             # parent folder does not exist yet
    summary = build_corpus([src, loose], out)
    want = expected_bytes(src, loose)
    assert summary == {"n_files": 4, "n_tokens": len(want), "path": str(out)}
    with h5py.File(out, "r") as h5:
        toks = h5["tokens"]
        assert toks.dtype == np.uint8 and toks.ndim == 1
        assert toks[()].tobytes() == want
        assert h5.attrs["vocab_size"] == 256 and h5.attrs["n_files"] == 4
        assert isinstance(h5.attrs["source"], str) and 0 < len(h5.attrs["source"]) <= 200


def test_build_uses_uint16_above_256(tmp_path, text_tree):
    src, loose = text_tree
    out = tmp_path / "wide.h5"
    build_corpus([src, loose], out, vocab_size=1000)
    with h5py.File(out, "r") as h5:
        assert h5["tokens"].dtype == np.uint16
        assert h5["tokens"][()].astype(np.uint8).tobytes() == expected_bytes(src, loose)
        assert h5.attrs["vocab_size"] == 1000
    ds = TokenDataset(out, seq_len=8, vocab_size=1000, val_fraction=0.2)
    assert ds.tokens.dtype == np.uint16


def test_build_is_deterministic_and_atomic(tmp_path, text_tree):
    src, loose = text_tree
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    build_corpus([src], out_dir / "one.h5")
    build_corpus([src], out_dir / "one.h5")          # overwrite in place through a temp + replace
    build_corpus([src], out_dir / "two.h5")
    assert sorted(p.name for p in out_dir.iterdir()) == ["one.h5", "two.h5"]
    with h5py.File(out_dir / "one.h5") as a, h5py.File(out_dir / "two.h5") as b:
        assert np.array_equal(a["tokens"][()], b["tokens"][()])


def test_failed_build_leaves_no_temp_file(tmp_path, text_tree):
    src, loose = text_tree
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(DataError, match="loose.dat"):
        build_corpus([src, loose], out_dir / "c.h5", vocab_size=128)   # 'é' is byte 0xC3 >= 128
    assert list(out_dir.iterdir()) == []


def test_build_missing_path_names_it(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match="nowhere"):
        build_corpus([missing], tmp_path / "c.h5")
    assert not (tmp_path / "c.h5").exists()


def test_build_with_no_text_files_is_an_error(tmp_path):
    (tmp_path / "only.bin").write_bytes(b"\0\1\2")
    with pytest.raises(DataError, match="no readable text files"):
        build_corpus([tmp_path], tmp_path / "c.h5")


# ----------------------------------------------------------------------------- built-in corpus

def test_default_corpus_path_honours_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HPENGINE_CACHE", str(tmp_path))
    path = data.default_corpus_path()
    assert path.parent == tmp_path and path.suffix == ".h5" and path.name.startswith("stdlib-3.")


def test_default_corpus_builds_from_stdlib_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("HPENGINE_CACHE", str(tmp_path / "cache"))
    path = data.ensure_default_corpus(max_bytes=200_000)
    assert path == data.default_corpus_path() and path.is_file()
    with h5py.File(path, "r") as h5:
        n, n_files = h5["tokens"].shape[0], int(h5.attrs["n_files"])
        assert 1 < n_files < 200 and 180_000 <= n < 200_000 + 2**20
        assert "stdlib" in h5.attrs["source"]
        text = h5["tokens"][:20_000].tobytes()
    assert b"import " in text or b"def " in text      # real Python source
    mtime = path.stat().st_mtime_ns
    assert data.ensure_default_corpus(max_bytes=200_000) == path
    assert path.stat().st_mtime_ns == mtime
    ds = TokenDataset(path, seq_len=64, vocab_size=256, val_fraction=0.1)
    assert ds.n_tokens("train") + ds.n_tokens("val") == n


def test_stdlib_selection_skips_tests_and_site_packages():
    files = builtin._stdlib_files(max_bytes=2**40)
    parts = {part for f in files for part in f.parts}
    assert files and not parts & {"test", "tests", "idle_test", "site-packages"}
    assert all(f.suffix == ".py" for f in files)


# ----------------------------------------------------------------------------- sampler

def test_splits_partition_the_tokens(corpus):
    ds = TokenDataset(corpus, seq_len=16, vocab_size=256, val_fraction=0.1)
    assert ds.n_tokens("train") == 18_000 and ds.n_tokens("val") == 2_000
    with pytest.raises(ValueError, match="split"):
        ds.n_tokens("test")


def test_batch_is_a_function_of_seed_step_split(corpus):
    ds = TokenDataset(corpus, seq_len=16, vocab_size=256, val_fraction=0.1)
    x1, y1 = ds.batch("train", step=3, seed=7, global_batch=8)
    ds.batch("train", step=9, seed=7, global_batch=8)            # unrelated draws in between
    again = TokenDataset(corpus, seq_len=16, vocab_size=256, val_fraction=0.1)
    x2, y2 = again.batch("train", step=3, seed=7, global_batch=8)
    assert x1.shape == y1.shape == (8, 16) and x1.dtype == np.int64
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    for other in ({"step": 4, "seed": 7}, {"step": 3, "seed": 8}):
        assert not np.array_equal(x1, ds.batch("train", global_batch=8, **other)[0])
    halves = TokenDataset(corpus, seq_len=16, vocab_size=256, val_fraction=0.5)  # equal lengths
    assert halves.n_tokens("train") == halves.n_tokens("val")
    assert not np.array_equal(halves.offsets("train", 3, 7, 8), halves.offsets("val", 3, 7, 8))


def test_offsets_cover_the_whole_valid_range(corpus):
    ds = TokenDataset(corpus, seq_len=16, vocab_size=256, val_fraction=0.5)
    offs = np.concatenate([ds.offsets("val", s, 0, 1000) for s in range(20)])
    n = ds.n_tokens("val")
    assert offs.min() >= 0 and offs.max() <= n - 16 - 1
    assert offs.max() > n - 16 - 30 and offs.min() < 30      # reaches both ends


def test_y_is_x_shifted_and_matches_the_tokens(corpus):
    ds = TokenDataset(corpus, seq_len=16, vocab_size=256, val_fraction=0.1)
    x, y = ds.batch("val", step=0, seed=1, global_batch=5)
    assert np.array_equal(x[:, 1:], y[:, :-1])
    val = ds.tokens[ds.n_tokens("train"):]
    for row, off in enumerate(ds.offsets("val", 0, 1, 5)):
        assert np.array_equal(x[row], val[off:off + 16])
        assert np.array_equal(y[row], val[off + 1:off + 17])


def test_slices_are_rows_of_the_global_batch(corpus):
    ds = TokenDataset(corpus, seq_len=12, vocab_size=256, val_fraction=0.1)
    x, y = ds.batch("train", step=11, seed=3, global_batch=12)
    for start, count in [(0, 12), (0, 3), (3, 3), (8, 4), (11, 1), (5, 0)]:
        xs, ys = ds.batch("train", step=11, seed=3, global_batch=12, start=start, count=count)
        assert xs.shape == (count, 12)
        assert np.array_equal(xs, x[start:start + count])
        assert np.array_equal(ys, y[start:start + count])
    xs, _ = ds.batch("train", step=11, seed=3, global_batch=12, start=7)   # count None: the rest
    assert np.array_equal(xs, x[7:])


@pytest.mark.parametrize("start, count", [(-1, 2), (0, 13), (10, 3), (13, None), (0, -1)])
def test_bad_slice_raises_value_error(corpus, start, count):
    ds = TokenDataset(corpus, seq_len=12, vocab_size=256, val_fraction=0.1)
    with pytest.raises(ValueError, match="start="):
        ds.batch("train", step=0, seed=0, global_batch=12, start=start, count=count)


# ----------------------------------------------------------------------------- validation

def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"data file '.*absent\.h5' not found/unreadable"):
        TokenDataset(tmp_path / "absent.h5", seq_len=8, vocab_size=256, val_fraction=0.1)


def test_folder_instead_of_file(tmp_path):
    with pytest.raises(DataError, match="not found/unreadable"):
        TokenDataset(tmp_path, seq_len=8, vocab_size=256, val_fraction=0.1)


def test_not_hdf5(tmp_path):
    path = tmp_path / "plain.txt"
    path.write_text("hello world\n" * 100)
    with pytest.raises(DataError, match=r"plain\.txt.*not an HDF5"):
        TokenDataset(path, seq_len=8, vocab_size=256, val_fraction=0.1)


def test_missing_tokens_lists_datasets(tmp_path):
    path = write_h5(tmp_path / "other.h5", ids=np.arange(10, dtype=np.uint8),
                    **{"grp/inner": np.zeros(3)})
    with pytest.raises(DataError, match=r"other\.h5.*'tokens'") as e:
        TokenDataset(path, seq_len=8, vocab_size=256, val_fraction=0.1)
    assert "ids" in str(e.value) and "grp/inner" in str(e.value)


@pytest.mark.parametrize("tokens", [np.arange(100, dtype=np.int64),          # signed
                                    np.zeros((10, 10), dtype=np.uint8),        # 2-D
                                    np.linspace(0, 1, 100)])                   # float
def test_tokens_must_be_1d_unsigned(tmp_path, tokens):
    path = write_h5(tmp_path / "bad.h5", tokens=tokens)
    with pytest.raises(DataError, match=r"bad\.h5.*1-D unsigned"):
        TokenDataset(path, seq_len=8, vocab_size=256, val_fraction=0.1)


def test_token_id_beyond_vocab(tmp_path):
    toks = np.zeros(1000, dtype=np.uint16)
    toks[500] = 300
    path = write_h5(tmp_path / "wide.h5", tokens=toks)
    for vocab in (256, 300):
        with pytest.raises(DataError, match=rf"wide\.h5.*300.*model\.vocab_size={vocab}"):
            TokenDataset(path, seq_len=8, vocab_size=vocab, val_fraction=0.1)
    assert TokenDataset(path, seq_len=8, vocab_size=301, val_fraction=0.1).tokens.dtype == np.uint16


def test_file_vocab_attribute_beyond_model_vocab(corpus):
    with h5py.File(corpus, "a") as h5:
        h5.attrs["vocab_size"] = 50_000
    with pytest.raises(DataError, match=r"tokens\.h5.*vocab_size=50000.*model\.vocab_size=256"):
        TokenDataset(corpus, seq_len=8, vocab_size=256, val_fraction=0.1)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_val_fraction_range(corpus, fraction):
    with pytest.raises(DataError, match=rf"^data\.val_fraction={fraction} is invalid"):
        TokenDataset(corpus, seq_len=8, vocab_size=256, val_fraction=fraction)


@pytest.mark.parametrize("fraction, short", [(0.001, "val"), (0.999, "train")])
def test_split_too_short_for_seq_len(corpus, fraction, short):
    with pytest.raises(DataError, match=rf"tokens\.h5.*'{short}'.*seq_len"):
        TokenDataset(corpus, seq_len=64, vocab_size=256, val_fraction=fraction)


def test_smallest_usable_split_is_seq_len_plus_one(tmp_path):
    path = write_h5(tmp_path / "tiny.h5", tokens=np.arange(18, dtype=np.uint8))
    ds = TokenDataset(path, seq_len=8, vocab_size=256, val_fraction=0.5)   # 9 + 9 tokens
    assert np.array_equal(ds.offsets("val", 0, 0, 50), np.zeros(50))
    with pytest.raises(DataError, match="seq_len"):
        TokenDataset(path, seq_len=9, vocab_size=256, val_fraction=0.5)


def test_truncated_file(tmp_path, corpus):
    cut = tmp_path / "cut.h5"
    cut.write_bytes(corpus.read_bytes()[:5000])
    with pytest.raises(DataError, match=r"cut\.h5' not found/unreadable"):
        TokenDataset(cut, seq_len=8, vocab_size=256, val_fraction=0.1)


def test_unreadable_file(tmp_path, corpus):
    if os.geteuid() == 0:
        pytest.skip("root reads files regardless of permissions")
    corpus.chmod(0)
    with pytest.raises(DataError, match="not found/unreadable"):
        TokenDataset(corpus, seq_len=8, vocab_size=256, val_fraction=0.1)
