"""Context-parallel attention over packed documents without MPI: the ring and all-gather drivers, run by cp
threads over test_ring_attention's in-process communicator, on each row split head-tail (positions shared by
the rows) or each document split head-tail (document_split: per-row positions within documents), mask by each
row's document segments as well as by position (against attention written out with the document mask), skip
a block no query shares a document with, and a change of one document's keys moves no other document's
output, bit for bit."""
import numpy as np
import pytest

import hpengine.strategies.context_parallel as driver
from hpengine.nn.context_split import document_split, head_tail_positions
from hpengine.nn.ring_attention import block_backward, block_forward, block_visible
from hpengine.strategies.context_parallel import CONTEXT_ATTENTION
from test_ring_attention import data, on_ranks  # tests/unit/test_ring_attention.py


def doc_oracle(q, k, v, do, seg, scale):
    """Attention of a whole row: a query sees earlier keys of its own document (seg (B, T)) -> o, dq, dk, dv."""
    B, H, T, hd = q.shape
    K = k.shape[1]
    g = H // K
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    ar = np.arange(T)
    masked = (ar[None, None, None, :] > ar[None, None, :, None]) | (seg[:, None, :, None] != seg[:, None, None, :])
    s = np.where(masked, -np.inf, np.einsum("bhtd,bhsd->bhts", q, kr) * scale)
    e = np.exp(s - s.max(axis=-1, keepdims=True))        # every query sees itself: no empty row
    p = e / e.sum(axis=-1, keepdims=True)
    o = np.einsum("bhts,bhsd->bhtd", p, vr)
    dp = np.einsum("bhtd,bhsd->bhts", do, vr)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhts,bhsd->bhtd", ds, kr) * scale
    dk = np.einsum("bhts,bhtd->bhsd", ds, q).reshape(B, K, g, T, hd).sum(axis=2) * scale
    dv = np.einsum("bhts,bhtd->bhsd", p, do).reshape(B, K, g, T, hd).sum(axis=2)
    return o, dq, dk, dv


def segments_of(lengths_per_row):
    return np.array([np.repeat(np.arange(len(ls)), ls) for ls in lengths_per_row], dtype=np.int64)


def within_documents(seg):
    """Each token's position within its document (its run of equal segments), (B, T)."""
    B, T = seg.shape
    pos = np.zeros((B, T), dtype=np.int64)
    for t in range(1, T):
        pos[:, t] = np.where(seg[:, t] == seg[:, t - 1], pos[:, t - 1] + 1, 0)
    return pos


def run_documents(how, q, k, v, do, seg, cp, split="head_tail"):
    """Each rank its part of q, k, v, do and of the segments -> o, dq, dk, dv whole again. head_tail: every
    row's head-tail columns, masked by their row positions; documents: document_split's columns of each row,
    masked by their positions within their documents (B, T / cp)."""
    B, T = seg.shape
    if split == "head_tail":
        cols = [np.broadcast_to(head_tail_positions(T, cp, r), (B, T // cp)) for r in range(cp)]
        pos = [head_tail_positions(T, cp, r) for r in range(cp)]
    else:
        order, n = document_split(seg, cp), T // cp
        cols = [order[:, r * n:(r + 1) * n] for r in range(cp)]
        pos = [np.take_along_axis(within_documents(seg), c, axis=1) for c in cols]
    take = lambda x, c: np.take_along_axis(x, c[:, None, :, None], axis=2)  # noqa: E731 - per-row columns
    fwd, bwd = CONTEXT_ATTENTION[how]

    def rank(comm):
        c, p = cols[comm.rank], pos[comm.rank]
        s = np.ascontiguousarray(np.take_along_axis(seg, c, axis=1))
        o, cache = fwd(np, comm, take(q, c), take(k, c), take(v, c), p, p, None, s, s)
        return (o, *bwd(np, comm, take(do, c), cache))

    res, _ = on_ranks(cp, rank)
    whole = []
    for i, ref in enumerate((q, q, k, v)):
        full = np.full_like(ref, np.nan)
        for r, c in enumerate(cols):
            np.put_along_axis(full, np.ascontiguousarray(c)[:, None, :, None], res[r][i], axis=2)
        whole.append(full)
    return whole


ROWS = [[3, 6, 1, 6], [16], [1, 1, 9, 5]]         # three rows of 16: short, whole, and mixed documents


@pytest.mark.parametrize("split", ["head_tail", "documents"])
@pytest.mark.parametrize("how", list(CONTEXT_ATTENTION))
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("H,K", [(2, 2), (4, 2)])
def test_equals_document_oracle(how, cp, H, K, split):
    seg = segments_of(ROWS)
    q, k, v, do = data(len(ROWS), H, K, 16, 4, seed=3)
    got = run_documents(how, q, k, v, do, seg, cp, split)
    for g, w in zip(got, doc_oracle(q, k, v, do, seg, 0.5)):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("split", ["head_tail", "documents"])
@pytest.mark.parametrize("how", list(CONTEXT_ATTENTION))
def test_one_document_changes_no_other(how, split):
    """Every key and value of row 0's second document changed: every other output and every gradient of
    another document's tokens the same bit for bit."""
    seg = segments_of(ROWS)
    q, k, v, do = data(len(ROWS), 2, 2, 16, 4, seed=4)
    k2, v2 = k.copy(), v.copy()
    k2[0, :, 3:9] += 1.5
    v2[0, :, 3:9] -= 2.0
    a = run_documents(how, q, k, v, do, seg, 2, split)
    b = run_documents(how, q, k2, v2, do, seg, 2, split)
    keep = np.ones(16, dtype=bool)
    keep[3:9] = False
    for x, y in zip(a, b):
        assert np.array_equal(x[0][:, keep], y[0][:, keep])
        assert np.array_equal(x[1:], y[1:])
    assert not np.array_equal(a[0][0][:, 3:9], b[0][0][:, 3:9])


def test_ring_skips_blocks_without_a_shared_document(monkeypatch):
    """cp 2 on 16 tokens: rank 0 holds positions 0-3 and 12-15, rank 1 4-11; documents [0, 4), [4, 12),
    [12, 16) leave neither rank a key of another rank's documents, so only the own blocks are attended."""
    calls = []
    real_f, real_b = driver.block_forward, driver.block_backward
    monkeypatch.setattr(driver, "block_forward", lambda *a, **kw: calls.append("f") or real_f(*a, **kw))
    monkeypatch.setattr(driver, "block_backward", lambda *a, **kw: calls.append("b") or real_b(*a, **kw))
    seg = segments_of([[4, 8, 4]])
    q, k, v, do = data(1, 2, 2, 16, 4, seed=5)
    got = run_documents("ring", q, k, v, do, seg, 2)
    assert calls.count("f") == 2 and calls.count("b") == 2
    for g, w in zip(got, doc_oracle(q, k, v, do, seg, 0.5)):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)
    calls.clear()
    run_documents("ring", q, k, v, do, np.zeros_like(seg), 2)     # one document: the other block is attended
    assert calls.count("f") == 4 and calls.count("b") == 4


def test_block_visible_by_document():
    q_pos, k_pos = np.arange(8, 12), np.arange(0, 4)
    assert block_visible(q_pos, k_pos)
    assert not block_visible(q_pos, k_pos, [[1, 1, 1, 1]], [[0, 0, 0, 0]])
    assert block_visible(q_pos, k_pos, [[0, 1, 1, 1]], [[0, 0, 0, 0]])
    # a key of the query's document that lies after every query of that document is not seen
    assert not block_visible([0, 1], [2, 3], [[0, 0]], [[0, 0]])


def test_a_block_with_no_visible_key_gives_empty_rows():
    """A row whose queries meet none of their documents' keys in the block: o = 0, lse = -inf, no gradient."""
    q, k, v, do = data(1, 2, 2, 4, 4, seed=6)
    o, lse = block_forward(np, q, k, v, np.arange(4, 8), np.arange(4), 0.5, [[1, 1, 2, 2]], [[0, 0, 0, 0]])
    assert np.all(o == 0) and np.all(np.isneginf(lse))
    dq, dk, dv = block_backward(np, q, k, v, o, lse, do, np.arange(4, 8), np.arange(4), 0.5, None,
                                [[1, 1, 2, 2]], [[0, 0, 0, 0]])
    assert not dq.any() and not dk.any() and not dv.any()


def test_block_visible_by_row_positions():
    """Per-row positions (B, T): a row sees a block only where one of its queries has a key of its own document
    at or before it; the rows do not share their positions."""
    q_pos, k_pos = np.array([[4, 5], [0, 1]]), np.array([[0, 1], [2, 3]])
    assert block_visible(q_pos, k_pos)                               # row 0 sees both keys
    assert not block_visible(q_pos[1:], k_pos[1:])                   # row 1's keys all after its queries
    assert not block_visible(q_pos, k_pos, [[1, 1], [0, 0]], [[0, 0], [0, 0]])
    assert block_visible(q_pos, k_pos, [[0, 1], [0, 0]], [[0, 0], [0, 0]])


def test_row_positions_mask_each_row_alone():
    """One block of per-row positions against the oracle on each row alone: a row whose document order
    differs from another's (here reversed halves) is masked by its own positions."""
    q, k, v, do = data(2, 2, 2, 4, 4, seed=7)
    pos = np.array([[0, 1, 2, 3], [2, 3, 0, 1]])                    # row 1 holds its tokens out of order
    seg = np.zeros((2, 4), dtype=np.int64)
    o, lse = block_forward(np, q, k, v, pos, pos, 0.5, seg, seg)
    back = block_backward(np, q, k, v, o, lse, do, pos, pos, 0.5, None, seg, seg)
    for b in range(2):
        idx = np.argsort(pos[b])                                     # the row in document order
        want = doc_oracle(q[b:b + 1, :, idx], k[b:b + 1, :, idx], v[b:b + 1, :, idx], do[b:b + 1, :, idx],
                          seg[b:b + 1], 0.5)
        for g, w in zip((o, *back), want):
            np.testing.assert_allclose(g[b:b + 1, :, idx], w, rtol=0, atol=1e-12)
