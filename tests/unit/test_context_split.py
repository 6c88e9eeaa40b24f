"""The head-tail split of a sequence over context-parallel ranks: which tokens each rank holds, the causal
work it gets (causal, and per packed document), reassembly, and the refusal of a length the chunks do not
divide."""
import numpy as np
import pytest

from hpengine.nn.context_split import (
    causal_products,
    check_split,
    chunk_size,
    contiguous_positions,
    document_work,
    gather_head_tail,
    head_tail_positions,
    split_sequence,
)


def test_seq8_on_2_ranks_by_hand():
    # 2 x 2 = 4 chunks of 2 tokens: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_size(8, 2) == 2
    assert head_tail_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert head_tail_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = np.arange(8)[None, :, None] * 10 + np.arange(3)[None, None, :]      # (1, 8, 3), token t = 10 t + j
    assert split_sequence(np, x, 2, 0)[0, :, 0].tolist() == [0, 10, 60, 70]
    assert split_sequence(np, x, 2, 1)[0, :, 0].tolist() == [20, 30, 40, 50]


def test_seq16_on_4_ranks_by_hand():
    assert [head_tail_positions(16, 4, r).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]


def test_products_balanced():
    # query at position p sees p + 1 keys: 1 + 2 + 7 + 8 = 18 and 3 + 4 + 5 + 6 = 18
    assert [causal_products(head_tail_positions(8, 2, r)) for r in range(2)] == [18, 18]
    # a contiguous split: 1 + 2 + 3 + 4 = 10 against 5 + 6 + 7 + 8 = 26
    assert [causal_products(contiguous_positions(8, 2, r)) for r in range(2)] == [10, 26]
    for T, cp in [(16, 4), (24, 3), (64, 8)]:
        work = {causal_products(head_tail_positions(T, cp, r)) for r in range(cp)}
        assert len(work) == 1 and work.pop() * cp == T * (T + 1) // 2


def test_every_token_once():
    for T, cp in [(8, 1), (8, 2), (16, 4), (24, 3)]:
        got = np.sort(np.concatenate([head_tail_positions(T, cp, r) for r in range(cp)]))
        assert got.tolist() == list(range(T))


@pytest.mark.parametrize("T,cp", [(8, 1), (8, 2), (16, 4), (12, 3)])
def test_round_trip(T, cp):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, T, 3, 4))
    parts = [split_sequence(np, x, cp, r) for r in range(cp)]
    assert all(p.shape == (2, T // cp, 3, 4) for p in parts)
    for r, p in enumerate(parts):
        np.testing.assert_array_equal(p, x[:, head_tail_positions(T, cp, r)])
    np.testing.assert_array_equal(gather_head_tail(np, parts), x)


def test_refusal_line():
    with pytest.raises(ValueError) as e:
        check_split(10, 2)
    msg = str(e.value)
    assert "\n" not in msg
    assert "seq_len 10 is not divisible by 4" in msg and "8 or 12" in msg
    with pytest.raises(ValueError, match="seq_len 6 is not divisible by 8"):
        head_tail_positions(6, 4, 0)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        head_tail_positions(8, 2, 2)
    check_split(8, 2)


def test_document_work_by_hand():
    """T 8 over cp 2 (rank 0: tokens 0, 1, 6, 7; rank 1: 2..5): one document balances, [2, 6] does not."""
    one = np.arange(8)[None]
    assert document_work(one, 2).tolist() == [18, 18] == [causal_products(head_tail_positions(8, 2, r))
                                                          for r in range(2)]
    two = np.array([[0, 1, 0, 1, 2, 3, 4, 5]])
    assert document_work(two, 2).tolist() == [1 + 2 + 5 + 6, 1 + 2 + 3 + 4]
    assert document_work(np.concatenate([one, two]), 2).tolist() == [32, 28]
