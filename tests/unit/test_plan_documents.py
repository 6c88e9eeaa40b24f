"""The planner's packed documents: the visible-pairs formula by hand, the window expectation against every
window of a periodic stream counted pair by pair, the geometric model's closed form by hand, the predicted
attention FLOPs of a step scaled by it, --check measuring a token file, and bad --mean-doc-len in one line."""
from __future__ import annotations

import numpy as np
import pytest

from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.data.documents import window_documents
from hpengine.data.format import BYTES, sha256_text, write_token_file
from hpengine.layout.resolve import resolve
from hpengine.planner import documents as D
from hpengine.planner.model import flops_per_microbatch, stage_facts
from hpengine.planner.search import Cluster

T = 16
TINY = ["model.kind=gpt", "model.d_model=16", "model.n_layers=2", "model.n_heads=4", f"model.seq_len={T}",
        "train.global_batch=4"]


def test_visible_pairs_by_hand():
    assert D.visible_pairs([8]) == 36                    # fully causal: T(T+1)/2
    assert D.visible_pairs([3, 5]) == 6 + 15
    assert D.visible_pairs([1] * 8) == 8                  # each token sees itself only


def test_window_expectation_equals_every_window_counted():
    """A stream that repeats a list of documents: the mean over every window start of one period of the pairs
    (i <= j) whose tokens share a document (window_documents' segments) is attention_from_lengths'."""
    lengths = np.array([3, 1, 7, 20, 2, 5, 11])
    n = int(lengths.sum())
    offsets = np.concatenate([[0], np.cumsum(np.tile(lengths, 4))])
    segments = window_documents(offsets, n + np.arange(n), T)[0]
    same = segments[:, :, None] == segments[:, None, :]
    pairs = np.triu(same).sum(axis=(1, 2))               # per window, key j >= query i: the visible pairs
    assert D.attention_from_lengths(lengths, T) == pytest.approx(pairs.mean() / (T * (T + 1) / 2), rel=1e-12)
    # two documents longer than a window: tokens k apart share one unless a boundary lies between them, for
    # k of the 30 T first tokens per document
    want = sum((T - k) * (30 * T - 2 * k) / (30 * T) for k in range(T)) / (T * (T + 1) / 2)
    assert D.attention_from_lengths([10 * T, 20 * T], T) == pytest.approx(want, rel=1e-12)


def test_geometric_lengths_by_hand():
    # T = 4, mean 2: lags 0..3 seen by 4, 3, 2, 1 pairs, in one document with chance (1/2)^k
    assert D.attention_from_mean(2, 4) == pytest.approx((4 + 3 / 2 + 2 / 4 + 1 / 8) / 10, rel=1e-15)
    assert D.attention_from_mean(1, T) == pytest.approx(2 / (T + 1), rel=1e-15)     # one token each
    assert D.from_mean(4, T).attention < D.from_mean(8, T).attention < D.from_mean(T, T).attention < 1


def test_predicted_attention_flops_scale_by_the_documents_share():
    """flops_per_microbatch of a gpt stage with documents: the weights' 6 N tokens unchanged, the attention's
    3 x (4 tokens T C) per layer times the share."""
    cfg = load_config(None, TINY)
    lay = resolve(cfg, 1)
    docs = D.from_mean(4, T)
    plain, packed = stage_facts(cfg, lay)[0], stage_facts(cfg, lay, docs)[0]
    assert packed.attention == docs.attention and plain.attention == 1.0
    tokens, C, L = lay.rows * T, 16, 2
    attention = 3 * 4 * tokens * T * C * L
    assert flops_per_microbatch(cfg.model, plain, lay) - flops_per_microbatch(cfg.model, packed, lay) == \
        pytest.approx(attention * (1 - docs.attention), rel=1e-12)
    assert flops_per_microbatch(cfg.model, packed, lay) == pytest.approx(
        6 * tokens * plain.matmul + attention * docs.attention, rel=1e-12)


def _short_docs(path, lengths):
    raw = path.with_suffix(".raw")
    np.random.default_rng(0).integers(1, 200, int(sum(lengths))).astype(np.uint8).tofile(raw)
    write_token_file(path, raw, np.uint8, np.concatenate([[0], np.cumsum(lengths)]),
                     {"vocab_size": 256, "eos_id": 0, "tokenizer": BYTES, "tokenizer_sha256": sha256_text(BYTES)})


def test_check_measures_the_token_file_and_reports_the_share(tmp_path, capsys):
    lengths = np.random.default_rng(1).integers(1, 12, size=200)
    _short_docs(tmp_path / "docs.h5", lengths)
    toml = tmp_path / "c.toml"
    toml.write_text("[model]\nkind = 'gpt'\nd_model = 16\nn_layers = 2\nn_heads = 4\nseq_len = 16\n"
                    f"[train]\nglobal_batch = 4\n[data]\npath = '{tmp_path / 'docs.h5'}'\ndocument_mask = true\n")
    share = D.attention_from_lengths(lengths, T)
    capsys.readouterr()
    assert main(["plan", "--check", str(toml), "--world", "1", "--nodes", "1", "--gpus-per-node", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())           # the line as printed, wrapped at 120 columns
    assert f"attention work {100 * share:.1f}% of fully causal" in out and "(200 documents: mean" in out
    assert "cp balance not modelled yet" in out
    cfg = load_config(toml)
    cluster = Cluster(nodes=1, gpus_per_node=1)
    from hpengine.planner.model import predict_layout
    with_docs = predict_layout(cfg, resolve(cfg, 1), cluster, docs=D.documents_of(cfg))["time"]["compute"]
    without = predict_layout(cfg, resolve(cfg, 1), cluster)["time"]["compute"]
    assert with_docs < without
    # the explicit mean wins over the file
    assert main(["plan", "--check", str(toml), "--world", "1", "--nodes", "1", "--gpus-per-node", "1",
                 "--mean-doc-len", "4"]) == 0
    assert f"--mean-doc-len 4 (geometric lengths): attention work {100 * D.attention_from_mean(4, T):.1f}%" in \
        " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("bad", ["0", "-3", "17", "nan"])
def test_bad_mean_doc_len_is_one_line(bad, capsys):
    capsys.readouterr()
    rc = main(["plan", "--check", "configs/default.toml", "--world", "1", "--nodes", "1", "--gpus-per-node", "1",
               *("--set", f"model.seq_len={T}"), "--mean-doc-len", bad])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--mean-doc-len" in err and f"model.seq_len = {T}" in err
