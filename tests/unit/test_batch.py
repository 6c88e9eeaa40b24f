"""Unit tests of the Batch (hpengine.data.batch): every cut (rows, the context-parallel head-tail split, per
document for packed rows) cuts every field alike, a default (None) field stays None, a rank that reads
nothing holds the shape alone, and a dataset's Batch holds the windows the token file has at the sampler's
offsets (read here with h5py)."""
from __future__ import annotations

from dataclasses import replace

import h5py
import numpy as np
import pytest

from hpengine.data import Batch, TokenDataset
from hpengine.engine.rows import RowReader
from hpengine.nn.context_split import document_ranks, head_tail_positions

B, T = 5, 16


def full(rng=None) -> Batch:
    """A batch with every field present, each telling rows and positions apart."""
    rng = rng or np.random.default_rng(0)
    tokens = rng.integers(0, 100, (B, T))
    seg = np.cumsum(rng.random((B, T)) < 0.2, axis=1)          # made-up documents: ids rise along a row
    return Batch(tokens, tokens + 1000, np.tile(np.arange(T), (B, 1)), seg, (rng.random((B, T)) < 0.7).astype(np.int8))


def test_row_slice_cuts_every_field():
    b = full()
    part = b.row_slice(1, 4)
    assert part.shape == (3, T)
    for name, a in b.present().items():
        assert np.array_equal(part.present()[name], a[1:4]), name
    assert set(part.present()) == set(b.present())


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_split_cuts_every_field_at_the_head_tail_positions(cp):
    b = replace(full(), segments=None)          # one document per row: the row is split head-tail
    for r in range(cp):
        idx = head_tail_positions(T, cp, r)         # the oracle: the positions this rank holds
        part = b.split_sequence(cp, r)
        assert part.shape == (B, T // cp)
        assert np.array_equal(part.positions, np.tile(idx, (B, 1)))
        for name, a in b.present().items():
            assert np.array_equal(part.present()[name], a[:, idx]), (cp, r, name)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_split_of_packed_rows_cuts_every_field_at_each_documents_split(cp):
    """Rows with segments: rank r holds, in row order, the columns document_ranks gives it; together the
    ranks hold every column once; positions left None are filled with 0..T-1 first (the mask reads them)."""
    b = full()
    ranks = document_ranks(b.segments, cp)
    seen = np.zeros((B, T), dtype=int)
    for r in range(cp):
        part = b.split_sequence(cp, r)
        assert part.shape == (B, T // cp)
        for i in range(B):
            cols = np.flatnonzero(ranks[i] == r)
            seen[i, cols] += 1
            for name, a in b.present().items():
                assert np.array_equal(part.present()[name][i], a[i, cols]), (cp, r, name)
        bare = replace(b, positions=None).split_sequence(cp, r)
        assert np.array_equal(bare.positions, part.positions)
    assert (seen == 1).all()


def test_default_positions_split_to_the_positions_the_context_derives():
    b = Batch(np.zeros((2, T), dtype=np.int64), np.ones((2, T), dtype=np.int64))
    assert b.defaults_only()
    full_pos = b.default_positions()
    assert np.array_equal(full_pos.positions, np.tile(np.arange(T), (2, 1)))
    for r in range(2):
        assert np.array_equal(full_pos.split_sequence(2, r).positions[1], head_tail_positions(T, 2, r))


def test_none_fields_stay_none():
    b = Batch(np.arange(B * T).reshape(B, T), np.arange(B * T).reshape(B, T) + 1)
    for part in (b.row_slice(0, 2), b.split_sequence(2, 1), b.to_device(np.asarray)):
        assert part.positions is None and part.segments is None and part.loss_mask is None
        assert set(part.present()) == {"tokens", "targets"}


def test_an_empty_batch_keeps_its_shape_through_every_cut():
    e = Batch.empty(8, T)
    assert e.present() == {} and e.tokens is None
    assert e.row_slice(2, 6).shape == (4, T)
    assert e.split_sequence(4, 3).shape == (8, T // 4)
    assert e.to_device(np.asarray).shape == (8, T)


def test_bad_batches_are_one_line():
    with pytest.raises(ValueError, match="share one"):
        Batch(np.zeros((2, 4)), np.zeros((2, 5)))
    with pytest.raises(ValueError, match="needs its shape"):
        Batch()
    with pytest.raises(ValueError, match="outside a batch of 5 rows"):
        full().row_slice(3, 6)
    with pytest.raises(ValueError, match="not divisible by 6"):
        full().split_sequence(3, 0)
    with pytest.raises(ValueError, match="not divisible by 6"):
        Batch.empty(2, T).split_sequence(3, 0)


def _file(path, n=4000):
    with h5py.File(path, "w") as h5:
        h5["tokens"] = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        h5.attrs["vocab_size"] = 256
    return path


def test_dataset_batch_holds_the_windows_of_the_file(tmp_path):
    path = _file(tmp_path / "t.h5")
    ds = TokenDataset(path, seq_len=T, vocab_size=256, val_fraction=0.1)
    with h5py.File(path) as h5:
        tokens = h5["tokens"][:].astype(np.int64)
    gb = 12
    _, offs = ds.rows("train", 3, 7, gb)
    want = np.stack([tokens[o:o + T + 1] for o in offs])        # split "train" starts at token 0 here
    b = ds.batch("train", 3, 7, gb, start=4, count=5)
    assert b.defaults_only() and b.shape == (5, T) and b.tokens.dtype == b.targets.dtype == np.int64
    assert np.array_equal(b.tokens, want[4:9, :-1]) and np.array_equal(b.targets, want[4:9, 1:])
    assert ds.rows_read == 5


class _Comm:
    """A tp group of one (RowReader reads and broadcasts nothing)."""
    rank, size = 0, 1


class _Backend:
    @staticmethod
    def to_device(a):
        return np.asarray(a)


def test_row_reader_reads_only_where_rows_are_computed_on(tmp_path):
    ds = TokenDataset(_file(tmp_path / "t.h5"), seq_len=T, vocab_size=256, val_fraction=0.1)
    mid = RowReader(ds, _Backend, 8, T, share=4, start=4, reads=False, tp=_Comm, cp=2, cp_rank=1)
    b = mid.read("train", 0, 1)
    assert b.present() == {} and b.shape == (4, T // 2) and ds.rows_read == 0
    edge = RowReader(ds, _Backend, 8, T, share=4, start=4, reads=True, tp=_Comm, cp=2, cp_rank=1)
    b = edge.read("train", 0, 1)
    whole = ds.batch("train", 0, 1, 8, start=4, count=4)
    assert ds.rows_read == 8
    assert np.array_equal(b.tokens, whole.split_sequence(2, 1).tokens) and b.shape == (4, T // 2)
