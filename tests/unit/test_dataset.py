"""Unit tests of reading token files for training (hpengine.data.dataset): the document-level split, a
separate validation file, blends of several files, the global-batch sampler, the consistency checks,
the memory a reader holds, and the tokenizer a run folder and checkpoint keep ([[data.sources]] config:
test_config.py).
Every file here is written with format.write_token_file (version 2) or h5py (version 1), not the builder."""
from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import tempfile
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpengine.checkpoint.shards import CheckpointError
from hpengine.config.load import load_config
from hpengine.data import DataError, TokenDataset
from hpengine.data.format import sha256_text, write_token_file
from hpengine.run.build import check_same_tokenizer
from hpengine.run.run_dir import tokenizer_json
from hpengine.run.train import train

def xy(batch):
    """A Batch's (tokens, targets), the pair batches were before they carried their metadata."""
    assert batch.defaults_only()
    return batch.tokens, batch.targets


HF = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}})


def v2(path, lengths, *, tokens=None, tokenizer="bytes", vocab=None, eos=-1, dtype=np.uint16):
    """A version-2 file of documents of `lengths` tokens; tokens default to 0, 1, 2, ... (a window's first
    token is then its position in the file)."""
    n = int(sum(lengths))
    tokens = np.arange(n) if tokens is None else np.asarray(tokens)
    raw = path.with_suffix(".raw")
    tokens.astype(dtype).tofile(raw)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    vocab = int(tokens.max()) + 1 if vocab is None else vocab
    write_token_file(path, raw, dtype, offsets, {"vocab_size": vocab, "eos_id": eos, "tokenizer": tokenizer,
                                                 "tokenizer_sha256": sha256_text(tokenizer)})
    raw.unlink()
    return path


def v1(path, tokens, **attrs):
    with h5py.File(path, "w") as h5:
        h5["tokens"] = tokens
        h5.attrs.update(attrs)
    return path


@pytest.fixture
def v1_corpus(tmp_path):
    """A 20k-token version-1 file of varied bytes, enough for any split at small seq_len."""
    return v1(tmp_path / "tokens.h5", np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8),
              vocab_size=256)


def old_offsets(n_windows, split, step, seed, global_batch):
    """The single-file sampler from its definition."""
    key = np.random.SeedSequence([0x64617461, seed, split, step]).generate_state(2, np.uint64)
    return (np.random.Philox(key=key).random_raw(global_batch) % np.uint64(n_windows)).astype(np.int64)


def blend_rows(weights, n_windows, split, step, seed, global_batch):
    """The blend sampler from its definition: offsets as above, then the next outputs of the same stream as
    53-bit uniforms picking each row's source by cumulative weight."""
    key = np.random.SeedSequence([0x64617461, seed, split, step]).generate_state(2, np.uint64)
    gen = np.random.Philox(key=key)
    raw, pick = gen.random_raw(global_batch), gen.random_raw(global_batch)
    cum = np.cumsum(weights) / np.sum(weights)
    src = [min(int(np.searchsorted(cum, (int(p) >> 11) / 2**53, side="right")), len(weights) - 1) for p in pick]
    return np.array(src), np.array([int(r) % n_windows[s] for r, s in zip(raw, src)])


# ----------------------------------------------------------------------------- document split

@pytest.mark.parametrize("fraction, boundary", [(0.25, 600), (0.5, 600), (0.7, 300), (0.71, 300),
                                                (0.69, 600), (0.95, 100), (0.999, 100)])
def test_document_split_starts_at_the_first_boundary_at_or_after_the_cut(tmp_path, fraction, boundary):
    path = v2(tmp_path / "d.h5", [100, 200, 300, 400])      # boundaries 0, 100, 300, 600, 1000
    with TokenDataset(path, seq_len=8, vocab_size=1000, val_fraction=fraction) as ds:
        assert (ds.n_tokens("train"), ds.n_tokens("val")) == (boundary, 1000 - boundary)
        for split, lo, hi in (("train", 0, boundary), ("val", boundary, 1000)):
            for step in range(5):
                x, y = xy(ds.batch(split, step, 3, 64))
                assert x[:, 0].min() >= lo and y[:, -1].max() < hi          # windows stay on their side
                assert np.array_equal(x, x[:, :1] + np.arange(8)) and np.array_equal(y, x + 1)


def test_split_never_cuts_a_document(tmp_path):
    rng = np.random.default_rng(5)
    for trial in range(20):
        lengths = rng.integers(20, 200, size=int(rng.integers(2, 12)))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        path = v2(tmp_path / f"r{trial}.h5", lengths)
        fraction = float(rng.uniform(0.01, 0.99))
        with TokenDataset(path, seq_len=4, vocab_size=int(offsets[-1]), val_fraction=fraction) as ds:
            cut = ds.n_tokens("train")
        assert cut in offsets[1:-1]                                       # a boundary, a document each side
        k, target = list(offsets).index(cut), int(offsets[-1] * (1 - fraction))
        assert cut >= target or k == len(lengths) - 1                     # at or after the cut ...
        assert offsets[k - 1] < target or k == 1                          # ... and the first such boundary


def test_single_document_is_refused_without_val_path(tmp_path):
    path = v2(tmp_path / "one.h5", [500])
    with pytest.raises(DataError, match=r"one\.h5' holds a single document \(500 tokens\).*data\.val_path") as e:
        TokenDataset(path, seq_len=8, vocab_size=500, val_fraction=0.1)
    assert "\n" not in str(e.value)
    val = v2(tmp_path / "val.h5", [50, 60], vocab=500)
    with TokenDataset(path, seq_len=8, vocab_size=500, val_fraction=0.1, val_path=val) as ds:
        assert (ds.n_tokens("train"), ds.n_tokens("val")) == (500, 110)


def test_val_path_is_the_whole_validation_split(tmp_path):
    train_file = v2(tmp_path / "t.h5", [300, 300], tokens=np.arange(600) % 100)
    val_file = v2(tmp_path / "v.h5", [40, 40], tokens=100 + np.arange(80) % 20, vocab=120)
    with pytest.raises(DataError, match="different|another tokenizer"):     # vocab_size differs: 100 vs 120
        TokenDataset(train_file, seq_len=8, vocab_size=128, val_fraction=0.5, val_path=val_file)
    train_file = v2(tmp_path / "t.h5", [300, 300], tokens=np.arange(600) % 100, vocab=120)
    with TokenDataset(train_file, seq_len=8, vocab_size=128, val_fraction=0.5, val_path=val_file) as ds:
        assert (ds.n_tokens("train"), ds.n_tokens("val")) == (600, 80)
        assert ds.batch("train", 0, 1, 32).tokens.max() < 100 and ds.batch("val", 0, 1, 32).tokens.min() >= 100


def test_version1_file_keeps_the_token_split_and_says_so(v1_corpus, caplog):
    with caplog.at_level(logging.INFO, logger="hpengine.data"):
        ds = TokenDataset(v1_corpus, seq_len=16, vocab_size=256, val_fraction=0.1)
    assert ds.n_tokens("train") == 18_000 and ds.n_tokens("val") == 2_000
    assert any("no document boundaries" in r.getMessage() and "tokens.h5" in r.getMessage() for r in caplog.records)
    assert (ds.tokenizer, ds.tokenizer_sha256, ds.eos_id, ds.vocab_size) == (None, None, -1, 256)
    with pytest.raises(ValueError, match="split"):
        ds.n_tokens("test")


# ----------------------------------------------------------------------------- the sampler

def test_single_file_offsets_are_the_philox_formula(tmp_path, v1_corpus):
    ds = TokenDataset(v1_corpus, seq_len=16, vocab_size=256, val_fraction=0.1)
    for split, code, n in (("train", 0, 18_000), ("val", 1, 2_000)):
        for step, seed in ((0, 0), (7, 1234), (123456, 2**63 + 5)):
            want = old_offsets(n - 16, code, step, seed & (2**64 - 1), 40)
            assert np.array_equal(ds.offsets(split, step, seed, 40), want)
    doc = v2(tmp_path / "d.h5", [100, 200, 300, 400])
    with TokenDataset(doc, seq_len=8, vocab_size=1000, val_fraction=0.5) as ds2:
        assert np.array_equal(ds2.offsets("val", 3, 9, 10), old_offsets(400 - 8, 1, 3, 9, 10))
        x, _ = xy(ds2.batch("val", 3, 9, 10))
        assert np.array_equal(x[:, 0], 600 + old_offsets(400 - 8, 1, 3, 9, 10))


def test_batch_is_a_function_of_seed_step_split(v1_corpus):
    ds = TokenDataset(v1_corpus, seq_len=16, vocab_size=256, val_fraction=0.1)
    x1, y1 = xy(ds.batch("train", step=3, seed=7, global_batch=8))
    ds.batch("train", step=9, seed=7, global_batch=8)            # unrelated draws in between
    again = TokenDataset(v1_corpus, seq_len=16, vocab_size=256, val_fraction=0.1)
    x2, y2 = xy(again.batch("train", step=3, seed=7, global_batch=8))
    assert x1.shape == y1.shape == (8, 16) and x1.dtype == np.int64
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    for other in ({"step": 4, "seed": 7}, {"step": 3, "seed": 8}):
        assert not np.array_equal(x1, ds.batch("train", global_batch=8, **other).tokens)
    halves = TokenDataset(v1_corpus, seq_len=16, vocab_size=256, val_fraction=0.5)  # equal lengths
    assert halves.n_tokens("train") == halves.n_tokens("val")
    assert not np.array_equal(halves.offsets("train", 3, 7, 8), halves.offsets("val", 3, 7, 8))


def test_offsets_cover_the_whole_valid_range(v1_corpus):
    ds = TokenDataset(v1_corpus, seq_len=16, vocab_size=256, val_fraction=0.5)
    offs = np.concatenate([ds.offsets("val", s, 0, 1000) for s in range(20)])
    n = ds.n_tokens("val")
    assert offs.min() >= 0 and offs.max() <= n - 16 - 1
    assert offs.max() > n - 16 - 30 and offs.min() < 30      # reaches both ends


def test_y_is_x_shifted_and_matches_the_tokens(v1_corpus):
    ds = TokenDataset(v1_corpus, seq_len=16, vocab_size=256, val_fraction=0.1)
    x, y = xy(ds.batch("val", step=0, seed=1, global_batch=5))
    assert np.array_equal(x[:, 1:], y[:, :-1])
    with h5py.File(v1_corpus) as h5:
        val = h5["tokens"][18_000:]
    for row, off in enumerate(ds.offsets("val", 0, 1, 5)):
        assert np.array_equal(x[row], val[off:off + 16]) and np.array_equal(y[row], val[off + 1:off + 17])


@pytest.fixture
def blend(tmp_path):
    """Three byte-level files whose tokens tell them apart (file i holds ids 10 i .. 10 i + 9)."""
    paths = [v2(tmp_path / f"s{i}.h5", [300, 200 + 100 * i], tokens=10 * i + np.arange(500 + 100 * i) % 10,
                vocab=256, eos=0, dtype=np.uint8) for i in range(3)]
    return paths, [(p, w) for p, w in zip(paths, (1.0, 2.0, 5.0))]


def test_blend_rows_follow_the_weights(blend):
    paths, sources = blend
    with TokenDataset("", 8, 256, 0.3, sources=sources) as ds:
        n_windows = [p.n - 8 for p in ds._split("train")[0]]
        counts = np.zeros(3)
        for step in range(200):
            src, offs = ds.rows("train", step, 11, 64)
            want_src, want_offs = blend_rows([1.0, 2.0, 5.0], n_windows, 0, step, 11, 64)
            assert np.array_equal(src, want_src) and np.array_equal(offs, want_offs)
            x, _ = xy(ds.batch("train", step, 11, 64))
            assert np.array_equal(x[:, 0] // 10, src)                  # each row read from its own file
            counts += np.bincount(src, minlength=3)
    expected = counts.sum() * np.array([1, 2, 5]) / 8
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 13.8, (counts, expected)                             # p = 0.001 at 2 degrees of freedom


def test_blend_validation_uses_each_files_own_split_by_the_same_weights(blend, tmp_path):
    paths, sources = blend
    with TokenDataset("", 8, 256, 0.3, sources=sources) as ds:
        assert [p.n for p in ds._split("val")[0]] == [200, 300, 400]    # the last document of each file
        src, _ = ds.rows("val", 0, 11, 4000)
        assert abs(np.mean(src == 2) - 5 / 8) < 0.03
    val = v2(tmp_path / "val.h5", [100, 100], tokens=np.full(200, 99), vocab=256, eos=0, dtype=np.uint8)
    with TokenDataset("", 8, 256, 0.3, sources=sources, val_path=val) as ds:
        assert ds.n_tokens("train") == sum(500 + 100 * i for i in range(3)) and ds.n_tokens("val") == 200
        assert (ds.batch("val", 0, 1, 16).tokens == 99).all()


def test_slices_are_rows_of_the_global_batch_and_instances_agree(blend):
    _, sources = blend
    ds, other = TokenDataset("", 8, 256, 0.3, sources=sources), TokenDataset("", 8, 256, 0.3, sources=sources)
    x, y = xy(ds.batch("train", step=11, seed=3, global_batch=12))
    for start, count in [(0, 12), (0, 3), (3, 3), (8, 4), (11, 1), (5, 0)]:
        xs, ys = xy(other.batch("train", step=11, seed=3, global_batch=12, start=start, count=count))
        assert xs.shape == (count, 8)
        assert np.array_equal(xs, x[start:start + count]) and np.array_equal(ys, y[start:start + count])
    xs, _ = xy(ds.batch("train", step=11, seed=3, global_batch=12, start=7))   # count None: the rest
    assert np.array_equal(xs, x[7:])
    ds.close()
    other.close()


@pytest.mark.parametrize("start, count", [(-1, 2), (0, 13), (10, 3), (13, None), (0, -1)])
def test_bad_slice_raises_value_error(v1_corpus, start, count):
    ds = TokenDataset(v1_corpus, seq_len=12, vocab_size=256, val_fraction=0.1)
    with pytest.raises(ValueError, match="start="):
        ds.batch("train", step=0, seed=0, global_batch=12, start=start, count=count)


def test_reading_holds_no_token_array(tmp_path):
    """A 200 MB file: opening it and drawing 100 batches allocates about a MiB, not the file."""
    raw, n = tmp_path / "zeros.raw", 100_000_000                     # uint16: 200 MB
    with open(raw, "wb") as f:
        f.truncate(2 * n)                                             # sparse: quick to make
    path = write_token_file(tmp_path / "big.h5", raw, np.uint16, np.linspace(0, n, 1001).astype(np.int64),
                            {"vocab_size": 50_000, "eos_id": 0, "tokenizer": HF,
                             "tokenizer_sha256": sha256_text(HF)})
    raw.unlink()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    try:
        ds = TokenDataset(path, seq_len=1024, vocab_size=50_000, val_fraction=0.01)
        for step in range(100):
            ds.batch("train", step, 1234, 512, start=8 * (step % 64), count=8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    assert peak < 4 * 2**20, f"{peak} bytes allocated"          # ~1 MiB: first-call set-up, a batch ~200 kB
    assert grew < 20 * 2**20, f"peak RSS grew by {grew} bytes"
    assert ds.tokenizer == HF and ds.vocab_size == 50_000
    ds.close()


# ----------------------------------------------------------------------------- consistency checks

def test_vocabulary_beyond_the_model_names_both_and_the_tokenizer(tmp_path):
    path = v2(tmp_path / "gpt2.h5", [10, 10], vocab=50257, tokenizer=HF, eos=50256)
    with pytest.raises(DataError) as e:
        TokenDataset(path, seq_len=4, vocab_size=256, val_fraction=0.5)
    assert str(e.value) == (f"data file '{path}' was built for vocab_size = 50257 (tokenizer BPE, sha256 "
                            f"{sha256_text(HF)[:8]}) but model.vocab_size = 256; set model.vocab_size >= 50257")
    with TokenDataset(path, seq_len=4, vocab_size=50257, val_fraction=0.5) as ds:
        assert (ds.vocab_size, ds.eos_id, ds.tokenizer, ds.tokenizer_sha256) == (50257, 50256, HF, sha256_text(HF))


def test_version1_vocabulary_is_its_largest_id(tmp_path):
    toks = np.zeros(1000, dtype=np.uint16)
    toks[500] = 300
    path = v1(tmp_path / "wide.h5", toks)
    for vocab in (256, 300):
        with pytest.raises(DataError, match=rf"wide\.h5' holds token ids up to 300, so needs vocab_size = 301 \(no "
                                            rf"tokenizer.*model\.vocab_size = {vocab}; set model.vocab_size >= 301"):
            TokenDataset(path, seq_len=8, vocab_size=vocab, val_fraction=0.1)
    assert TokenDataset(path, seq_len=8, vocab_size=301, val_fraction=0.1).vocab_size == 301


def test_version1_vocab_attribute_beyond_model_vocab(v1_corpus):
    with h5py.File(v1_corpus, "a") as h5:
        h5.attrs["vocab_size"] = 50_000
    with pytest.raises(DataError, match=r"tokens\.h5' was built for vocab_size = 50000.*model\.vocab_size = 256"):
        TokenDataset(v1_corpus, seq_len=8, vocab_size=256, val_fraction=0.1)


def test_a_blend_shares_one_tokenizer(tmp_path, blend):
    paths, sources = blend
    hf = v2(tmp_path / "hf.h5", [300, 300], vocab=256, tokenizer=HF, eos=0, dtype=np.uint8,
            tokens=np.arange(600) % 256)
    with pytest.raises(DataError, match=rf"s0\.h5' \(vocab_size = 256, eos_id = 0, tokenizer bytes.*hf\.h5' "
                                        r"\(vocab_size = 256, eos_id = 0, tokenizer BPE.*share one tokenizer"):
        TokenDataset("", 8, 256, 0.3, sources=[sources[0], (hf, 1.0)])
    old = v1(tmp_path / "old.h5", np.arange(600, dtype=np.uint8) % 200)
    with pytest.raises(DataError, match=r"old\.h5' \(no tokenizer recorded"):
        TokenDataset("", 8, 256, 0.3, sources=[sources[0], (old, 1.0)])
    with pytest.raises(DataError, match=r"data\.val_path '.*old\.h5'.*another tokenizer than '.*s0\.h5'"):
        TokenDataset(paths[0], 8, 256, 0.3, val_path=old)
    older = v1(tmp_path / "older.h5", np.arange(600, dtype=np.uint8) % 250, vocab_size=256)
    with TokenDataset("", 8, 256, 0.3, sources=[(old, 1.0), (older, 1.0)]) as ds:   # version 1 with version 1
        assert ds.vocab_size == 256 and ds.tokenizer is None


def test_path_and_sources_are_exclusive(blend):
    paths, sources = blend
    with pytest.raises(DataError, match=r"data\.path = '.*s0\.h5' and data\.sources \(3 files\) are both set"):
        TokenDataset(paths[0], 8, 256, 0.3, sources=sources)


@pytest.mark.parametrize("fraction, short", [(0.001, "val"), (0.999, "train")])
def test_split_too_short_for_seq_len(v1_corpus, fraction, short):
    with pytest.raises(DataError, match=rf"tokens\.h5.*'{short}'.*seq_len"):
        TokenDataset(v1_corpus, seq_len=64, vocab_size=256, val_fraction=fraction)


def test_smallest_usable_split_is_seq_len_plus_one(tmp_path):
    path = v1(tmp_path / "tiny.h5", np.arange(18, dtype=np.uint8))
    ds = TokenDataset(path, seq_len=8, vocab_size=256, val_fraction=0.5)   # 9 + 9 tokens
    assert np.array_equal(ds.offsets("val", 0, 0, 50), np.zeros(50))
    with pytest.raises(DataError, match="seq_len"):
        TokenDataset(path, seq_len=9, vocab_size=256, val_fraction=0.5)
    short_doc = v2(tmp_path / "short.h5", [100, 5])
    with pytest.raises(DataError, match=r"short\.h5': split 'val' has 5 tokens, fewer than model\.seq_len \+ 1 = 9"):
        TokenDataset(short_doc, seq_len=8, vocab_size=105, val_fraction=0.5)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_val_fraction_range(v1_corpus, fraction):
    with pytest.raises(DataError, match=rf"^data\.val_fraction={fraction} is invalid"):
        TokenDataset(v1_corpus, seq_len=8, vocab_size=256, val_fraction=fraction)


# ----------------------------------------------------------------------------- unusable files

def test_missing_file_and_folder(tmp_path):
    with pytest.raises(DataError, match=r"data file '.*absent\.h5' not found/unreadable"):
        TokenDataset(tmp_path / "absent.h5", seq_len=8, vocab_size=256, val_fraction=0.1)
    with pytest.raises(DataError, match="not found/unreadable"):
        TokenDataset(tmp_path, seq_len=8, vocab_size=256, val_fraction=0.1)


def test_not_hdf5(tmp_path):
    path = tmp_path / "plain.txt"
    path.write_text("hello world\n" * 100)
    with pytest.raises(DataError, match=r"plain\.txt.*not an HDF5"):
        TokenDataset(path, seq_len=8, vocab_size=256, val_fraction=0.1)


def test_missing_tokens_lists_datasets(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as h5:
        h5["ids"], h5["grp/inner"] = np.arange(10, dtype=np.uint8), np.zeros(3)
    with pytest.raises(DataError, match=r"other\.h5.*'tokens'") as e:
        TokenDataset(path, seq_len=8, vocab_size=256, val_fraction=0.1)
    assert "ids" in str(e.value) and "grp/inner" in str(e.value)


@pytest.mark.parametrize("tokens", [np.arange(100, dtype=np.int64), np.zeros((10, 10), dtype=np.uint8),
                                    np.linspace(0, 1, 100)])
def test_tokens_must_be_1d_unsigned(tmp_path, tokens):
    path = v1(tmp_path / "bad.h5", tokens)
    with pytest.raises(DataError, match=r"bad\.h5.*1-D unsigned"):
        TokenDataset(path, seq_len=8, vocab_size=256, val_fraction=0.1)


def test_truncated_file(tmp_path, v1_corpus):
    cut = tmp_path / "cut.h5"
    cut.write_bytes(v1_corpus.read_bytes()[:5000])
    with pytest.raises(DataError, match=r"cut\.h5' not found/unreadable"):
        TokenDataset(cut, seq_len=8, vocab_size=256, val_fraction=0.1)


NOBODY = 65534


def _open_as_nobody(path) -> str:
    """What TokenDataset(path) does in a forked child that has dropped to uid and gid 65534 (root's
    permission override goes with uid 0): "opened", or the exception's type and message."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: report through the pipe, never return
        try:
            os.close(r)
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            except OSError as e:
                msg = f"cannot drop to uid {NOBODY}: {e}"
            else:
                try:
                    TokenDataset(path, seq_len=8, vocab_size=256, val_fraction=0.1)
                    msg = "opened"
                except BaseException as e:  # noqa: BLE001 - reported to the parent, which judges it
                    msg = f"{type(e).__name__}: {e}"
            os.write(w, msg.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode()
    os.waitpid(pid, 0)
    return msg


def test_unreadable_file(v1_corpus):
    """A token file its reader may not read (mode 000) is refused as "not a readable file". Root reads any
    file, so as root the open runs in a child that drops to uid 65534, from a folder that user can enter, and
    the same file with mode 644 must open there (it is the mode that is refused, nothing else)."""
    if os.geteuid() != 0:
        v1_corpus.chmod(0)
        with pytest.raises(DataError, match=r"tokens\.h5' not found/unreadable: not a readable file"):
            TokenDataset(v1_corpus, seq_len=8, vocab_size=256, val_fraction=0.1)
        return
    folder = Path(tempfile.mkdtemp(prefix="hpengine-unreadable-"))
    try:
        folder.chmod(0o755)
        path = folder / "tokens.h5"
        shutil.copy(v1_corpus, path)
        path.chmod(0o644)
        msg = _open_as_nobody(path)
        if msg.startswith("cannot drop"):
            pytest.skip(msg)                       # e.g. a user namespace without uid 65534 mapped
        assert msg == "opened"
        path.chmod(0)
        msg = _open_as_nobody(path)
        assert msg.startswith("DataError: ") and f"'{path}' not found/unreadable: not a readable file" in msg, msg
    finally:
        shutil.rmtree(folder)


def test_directory_is_not_a_token_file(tmp_path):
    with pytest.raises(DataError, match=r"not found/unreadable: not a readable file"):
        TokenDataset(tmp_path, seq_len=8, vocab_size=256, val_fraction=0.1)


# ----------------------------------------------------------------------------- run folder and resume

class Data:
    def __init__(self, sha, tokenizer="bytes", paths=("now.h5",)):
        self.tokenizer_sha256, self.tokenizer, self.paths = sha, tokenizer, list(paths)


def test_resume_refuses_another_tokenizer():
    check_same_tokenizer(None, Data("abc"))                                   # a checkpoint of older hpengine
    check_same_tokenizer({"tokenizer_sha256": None, "files": ["old.h5"]}, Data("abc"))     # version-1 data
    check_same_tokenizer({"tokenizer_sha256": "abc", "files": ["old.h5"]}, Data("abc"))
    for now in ("def", None):
        with pytest.raises(CheckpointError) as e:
            check_same_tokenizer({"tokenizer_sha256": "abc", "files": ["old.h5"]}, Data(now))
        msg = str(e.value)
        assert "sha256 abc (old.h5)" in msg and f"sha256 {now or 'none'}" in msg and "now.h5" in msg


def test_tokenizer_json():
    assert json.loads(tokenizer_json(Data("x", "bytes"))) == {"hpengine": "bytes"}
    assert tokenizer_json(Data("x", HF)) == HF
    assert tokenizer_json(Data(None, None)) is None


TINY = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
        "train.global_batch=4", "runtime.backend='numpy'", "train.eval_every=0", "train.log_every=1"]


def test_a_blended_run_keeps_its_tokenizer_and_resume_checks_it(tmp_path, blend):
    _, sources = blend
    out = tmp_path / "run"
    blend_sets = ["data.sources=[" + ", ".join(f'{{path="{p}", weight={w}}}' for p, w in sources) + "]"]
    cfg = load_config(None, TINY + blend_sets + [f"train.out_dir={out}", "train.steps=2", "checkpoint.every=2"])
    summary = train(cfg)
    assert json.loads((out / "tokenizer.json").read_text()) == {"hpengine": "bytes"}
    assert summary["tokenizer_sha256"] == sha256_text("bytes")
    assert json.loads((out / "summary.json").read_text())["tokenizer_sha256"] == sha256_text("bytes")
    manifest = json.loads(next(out.glob("checkpoints/step_*/manifest.json")).read_text())
    assert manifest["data"] == {"tokenizer_sha256": sha256_text("bytes"), "files": [str(p) for p, _ in sources]}
    hf = v2(tmp_path / "hf.h5", [300, 300], vocab=256, tokenizer=HF, eos=0, dtype=np.uint8,
            tokens=np.arange(600) % 256)
    more = load_config(None, TINY + [f"data.path={hf}", f"train.out_dir={out}", "train.steps=4"])
    with pytest.raises(CheckpointError, match=rf"--resume latest: .*sha256 {sha256_text('bytes')} .*s0\.h5.*"
                                              rf"sha256 {sha256_text(HF)} \(.*hf\.h5\)"):
        train(more, resume="latest")
