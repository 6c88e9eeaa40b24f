"""Packed documents (data.document_mask) on one process: a batch's documents from a token file's offsets, the
packing test (float64: packed rows give each document's loss, and in sum the gradients, of the documents run
alone) for gpt and llama, standard and flash attention and an MoE llama, and the leak test (changing one
document changes no logit of another, bit for bit)."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from hpengine.config.load import load_config
from hpengine.data import TokenDataset
from hpengine.data.batch import Batch
from hpengine.data.documents import counted_targets, length_summary, window_documents
from hpengine.data.format import sha256_text, write_token_file
from hpengine.models.context import with_documents
from hpengine.nn import flash
from hpengine.run.build import build

LENGTHS = [5, 3, 7, 4, 6, 9, 2, 8, 5, 11]


def token_file(path, lengths, vocab=None):
    """A file of documents of `lengths` tokens; token i is i (mod vocab)."""
    n = int(sum(lengths))
    vocab = vocab or n
    raw = path.with_suffix(".raw")
    (np.arange(n) % vocab).astype(np.uint16).tofile(raw)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    write_token_file(path, raw, np.uint16, offsets, {"vocab_size": vocab, "eos_id": -1, "tokenizer": "bytes",
                                                     "tokenizer_sha256": sha256_text("bytes")})
    raw.unlink()
    return path


def test_window_documents_by_hand():
    offsets = np.array([0, 5, 8, 15, 19, 25])
    seg, pos, mask = window_documents(offsets, [3, 0, 15], 6)
    # from 3, inside the first document: tokens 3..8 lie in documents 0 0 1 1 1 2, targets 4..9 in 0 1 1 1 2 2
    np.testing.assert_array_equal(seg, [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(pos, [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 1]])
    np.testing.assert_array_equal(mask, [[1, 0, 1, 1, 0, 1], [1, 1, 1, 1, 0, 1], [1, 1, 1, 0, 1, 1]])
    assert counted_targets(offsets, [3, 0, 15], 6) == mask.sum()


def test_dataset_batch_carries_documents(tmp_path):
    path = token_file(tmp_path / "d.h5", LENGTHS)
    offsets = np.concatenate([[0], np.cumsum(LENGTHS)])
    with TokenDataset(path, seq_len=6, vocab_size=100, val_fraction=0.2, document_mask=True) as ds:
        for step in range(4):
            b = ds.batch("train", step, 1, 16)
            starts = b.tokens[:, 0]               # token i of the file has id i: a row's first id is its start
            doc = np.searchsorted(offsets, b.tokens, side="right") - 1
            np.testing.assert_array_equal(b.segments, doc - doc[:, :1])
            np.testing.assert_array_equal(b.positions, b.tokens - np.maximum(offsets[doc], starts[:, None]))
            tdoc = np.searchsorted(offsets, b.targets, side="right") - 1
            np.testing.assert_array_equal(b.loss_mask, (tdoc == doc).astype(int))
            assert ds.counted("train", step, 1, 16) == b.loss_mask.sum()
            meta = ds.batch("train", step, 1, 16, start=4, count=8, tokens=False)
            assert meta.tokens is None and meta.targets is None
            np.testing.assert_array_equal(meta.segments, b.segments[4:12])
            np.testing.assert_array_equal(meta.loss_mask, b.loss_mask[4:12])
    with TokenDataset(path, seq_len=6, vocab_size=100, val_fraction=0.2) as ds:
        assert ds.batch("train", 0, 1, 4).defaults_only() and ds.counted("train", 0, 1, 4) == 24


def test_length_summary():
    assert length_summary([0, 2, 6, 7]) == "3 documents: mean 2.3, median 2, p99 4, longest 4 tokens"


# --------------------------------------------------------------------------------------- the packing test
B, T, V = 2, 16, 32
ROWS = [[5, 7, 4], [9, 2, 5]]        # documents per packed row
KINDS = {"gpt": ["model.kind=gpt", "model.n_heads=2"],
         "llama": ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=24",
                   "model.rope_theta=100"],
         "moe": ["model.kind=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=24",
                 "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.dense_layers=0",
                 "model.moe.capacity_factor=0", "model.moe.aux_loss=0", "model.moe.z_loss=0"]}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return token_file(tmp_path_factory.mktemp("packed") / "tokens.h5", [40] * 50, V)


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(flash, "BQ", 4)     # tiles of 4: some lie in one document, some no document spans
    monkeypatch.setattr(flash, "BK", 3)
    monkeypatch.setattr(flash, "BQ_DOCS", 4)     # the packed rows' own tile sizes
    monkeypatch.setattr(flash, "BK_DOCS", 3)


def make(corpus, kind, attention, *extra):
    cfg = load_config(None, [*KINDS[kind], f"model.vocab_size={V}", f"model.seq_len={T}", "model.d_model=16",
                             "model.n_layers=2", f"model.attention={attention}", "model.dtype=float64",
                             "model.init_std=0.3", f"train.global_batch={B}", "runtime.backend=numpy",
                             f"data.path={corpus}", *extra])
    eng = build(cfg, MPI.COMM_SELF)
    eng.sync.params.data += np.random.default_rng(3).normal(0.0, 0.1, eng.layout.total)
    return eng


def packed(tokens):
    """The packed Batch of ROWS over tokens (B, T): targets the next token, not counted across a boundary (nor
    at a row's end)."""
    seg, pos = np.zeros((B, T), dtype=np.int64), np.zeros((B, T), dtype=np.int64)
    for r, lens in enumerate(ROWS):
        at = 0
        for d, n in enumerate(lens):
            seg[r, at:at + n], pos[r, at:at + n] = d, np.arange(n)
            at += n
    targets = np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    mask = np.ones((B, T), dtype=np.int64)
    mask[:, :-1] = seg[:, 1:] == seg[:, :-1]
    mask[:, -1] = 0
    return Batch(tokens, targets, pos, seg, mask)


def documents(batch):
    """(row, first, end) of every document of the packed batch."""
    out = []
    for r, lens in enumerate(ROWS):
        ends = np.cumsum(lens)
        out += [(r, int(e - n), int(e)) for n, e in zip(lens, ends)]
    return out


def pass_of(eng, batch, norm, last=True, grad=True):
    return float(eng.forward_backward(eng.slots[0], batch, norm, grad=grad, last_pass=last))


@pytest.mark.parametrize("kind, attention", [("gpt", "standard"), ("gpt", "flash"), ("llama", "standard"),
                                             ("llama", "flash"), ("moe", "standard")])
def test_packed_rows_train_as_documents_alone(corpus, small_blocks, kind, attention):
    eng = make(corpus, kind, attention)
    tokens = np.random.default_rng(0).integers(0, V, (B, T))
    batch = packed(tokens)
    norm = float(batch.loss_mask.sum())
    eng.sync.begin_step()
    loss = pass_of(eng, batch, norm)
    grads = np.array(eng.sync.grads.data)
    docs = documents(batch)
    eng.sync.begin_step()
    alone = []
    for i, (r, a, e) in enumerate(docs):     # each document alone, its own sequence from position 0
        x = tokens[r:r + 1, a:e - 1]
        alone.append(pass_of(eng, Batch(x, tokens[r:r + 1, a + 1:e]), norm, last=i == len(docs) - 1))
    np.testing.assert_allclose(np.array(eng.sync.grads.data), grads, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(sum(alone), loss, rtol=1e-10)
    for (r, a, e), want in zip(docs, alone):     # per document: the packed batch counting only its targets
        mask = np.zeros((B, T), dtype=np.int64)
        mask[r, a:e - 1] = 1
        one = Batch(batch.tokens, batch.targets, batch.positions, batch.segments, mask)
        np.testing.assert_allclose(pass_of(eng, one, norm, grad=False), want, rtol=1e-10)


@pytest.mark.parametrize("kind, attention", [("gpt", "standard"), ("gpt", "flash"), ("llama", "standard"),
                                             ("llama", "flash")])
def test_no_document_leaks_into_another(corpus, small_blocks, kind, attention):
    eng = make(corpus, kind, attention)
    tokens = np.random.default_rng(1).integers(0, V, (B, T))
    changed = tokens.copy()
    changed[0, 5:12] = (changed[0, 5:12] + 1 + np.arange(7)) % V       # every token of row 0's second document
    a, b = logits(eng, packed(tokens)), logits(eng, packed(changed))
    keep = np.ones((B, T), dtype=bool)
    keep[0, 5:12] = False
    assert np.array_equal(a[keep], b[keep])                            # bit for bit
    assert not np.array_equal(a[0, 5:12], b[0, 5:12])


def logits(eng, batch):
    """The head's logits of this rank's positions of a packed batch (forward through the engine's blocks)."""
    slot, m = eng.slots[0], eng.slots[0].model
    ctx = with_documents(eng.ctx, batch)
    h = None
    for name in slot.chunks[0]:
        blk = slot.block(name)
        if blk.kind == "embed":
            h, _ = m.embed_forward(np, eng._P(slot, name), batch.tokens, ctx)
        elif blk.kind == "layer":
            h, _ = m.layer_forward(np, eng._P(slot, name), blk.layer, h, ctx)
        else:
            return m.head_logits(np, eng._P(slot, name), h)
    raise AssertionError("no head")


def test_stage_without_rows_reads_their_documents(tmp_path):
    """A pipeline stage that computes on no rows still holds their documents (its attention reads them), taken
    from the offsets: no token is read."""
    from hpengine.device.backend import Backend
    from hpengine.engine.rows import RowReader
    path = token_file(tmp_path / "d.h5", LENGTHS)
    with TokenDataset(path, seq_len=6, vocab_size=100, val_fraction=0.2, document_mask=True) as ds:
        rows = RowReader(ds, Backend("numpy", "float64"), 8, 6, 4, 4, False, None)
        got = rows.read("train", 2, 1)
        assert got.tokens is None and ds.rows_read == 0
        want = ds.batch("train", 2, 1, 8, start=4, count=4)
        for f in ("segments", "positions", "loss_mask"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f))
        assert rows.norm("train", 2, 1) == ds.batch("train", 2, 1, 8).loss_mask.sum()


def test_data_info_prints_document_lengths(tmp_path):
    from hpengine.cli.commands import _data_info
    out = _data_info(token_file(tmp_path / "d.h5", [2, 4, 1]))
    assert "document lengths: 3 documents: mean 2.3, median 2, p99 4, longest 4 tokens" in out
