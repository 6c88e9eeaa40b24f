"""The per-document split of packed rows over context-parallel ranks (document_split): a hand case, every token
held once and T / cp per rank, the rule read from each row alone (deterministic, rows independent), and the
figure: on synthetic documents of mean length 512 the busiest rank's work is within 1.1x of the mean where
splitting each packed row head-tail is not."""
import numpy as np
import pytest

from hpengine.data.documents import window_documents
from hpengine.nn.context_split import (
    document_ranks,
    document_split,
    document_work,
    imbalance,
    split_work,
)


def segments_of(lengths):
    return np.repeat(np.arange(len(lengths)), lengths)[None]


def positions_of(lengths):
    return np.concatenate([np.arange(n) for n in lengths])[None]


def test_by_hand_cp2():
    """T 16, documents 8, 3, 5 over cp 2 (4 chunks a document): the 8 splits 2 2 2 2 head-tail (ranks 0 1 1
    0); the 5 sets its first token aside and splits the other 4 as 1 1 1 1; the 3 is set aside whole. The
    aside tokens, heaviest first (positions 2, 1, 0 of the 3, then 0 of the 5), are dealt 0 1 1 0."""
    L = [8, 3, 5]
    want = [0, 0, 1, 1, 1, 1, 0, 0] + [1, 1, 0] + [0, 0, 1, 1, 0]
    assert document_ranks(segments_of(L), 2).tolist() == [want]
    order = document_split(segments_of(L), 2)
    assert order.tolist() == [[0, 1, 6, 7, 10, 11, 12, 15, 2, 3, 4, 5, 8, 9, 13, 14]]
    # work: position + 1 of each query; head-tail of the packed row gives 24 and 33
    assert split_work(segments_of(L), positions_of(L), 2).tolist() == [29, 28]
    assert document_work(positions_of(L), 2).tolist() == [24, 33]


def test_a_divisible_document_is_split_head_tail():
    """One document of T tokens: the per-document split is the head-tail split of the row."""
    seg = np.zeros((1, 16), dtype=np.int64)
    assert document_ranks(seg, 4).tolist() == [[0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1, 0, 0]]


def random_rows(rng, rows, T, mean):
    """Windows of T tokens at random starts of a stream of documents with exponential lengths of `mean`:
    (segments, positions) as the data pipeline makes them (data/documents.py)."""
    n = int(rows * T / mean * 4) + 16
    lengths = np.maximum(1, rng.exponential(mean, n).astype(np.int64))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    starts = rng.integers(0, offsets[-1] - T - 1, rows)
    seg, pos, _ = window_documents(offsets, starts, T)
    return seg, pos


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("mean", [1, 3, 17, 60])
def test_every_token_once_and_the_same_count_per_rank(cp, mean):
    rng = np.random.default_rng(cp * 100 + mean)
    T = 2 * cp * 12
    seg, pos = random_rows(rng, 6, T, mean)
    order = document_split(seg, cp)
    assert order.shape == seg.shape
    assert (np.sort(order, axis=1) == np.arange(T)).all()            # a permutation of every row
    ranks = document_ranks(seg, cp)
    assert all((np.bincount(r, minlength=cp) == T // cp).all() for r in ranks)
    n = T // cp
    for r in range(cp):                                              # rank r's columns, ascending
        part = order[:, r * n:(r + 1) * n]
        assert (np.diff(part, axis=1) > 0).all()
        assert (np.take_along_axis(ranks, part, axis=1) == r).all()
    assert split_work(seg, pos, cp).sum() == (pos + 1).sum() == document_work(pos, cp).sum()


def test_deterministic_and_row_by_row():
    """The same segments give the same split, whatever rows stand beside them and whatever their ids."""
    seg, _ = random_rows(np.random.default_rng(5), 8, 48, 9)
    whole = document_split(seg, 4)
    assert np.array_equal(whole, document_split(seg.copy(), 4))
    for i in range(8):
        assert np.array_equal(whole[i:i + 1], document_split(seg[i:i + 1], 4))
        assert np.array_equal(whole[i:i + 1], document_split(seg[i:i + 1] * 3 + 7, 4))


def test_refusals():
    with pytest.raises(ValueError, match="not divisible by 8"):
        document_split(np.zeros((1, 12), dtype=np.int64), 4)


def test_balance_figure_cp4():
    """T 4096, documents of mean length 512 (exponential), 64 rows, cp 4: busiest / mean within 1.1 with
    the per-document split, beyond it with each packed row split head-tail."""
    seg, pos = random_rows(np.random.default_rng(0), 64, 4096, 512)
    per_document = imbalance(split_work(seg, pos, 4))
    head_tail = imbalance(document_work(pos, 4))
    assert per_document <= 1.1 < head_tail
    assert per_document < 1.01
