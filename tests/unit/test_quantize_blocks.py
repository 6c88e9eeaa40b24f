"""Quantisation blocks of whole tensors without MPI: which global blocks a rank's slice of a tensor meets (worked out by
hand), tp padding left out, and two tp ranks of two islands exchanging int8/int4 through the scales' MAX against the
rounding of the whole tensor written out here (test_quantize.py's)."""
from dataclasses import dataclass

import numpy as np
import pytest

from hpengine.params import blocks
from hpengine.strategies import quantize


@dataclass(frozen=True)
class Spec:
    global_shape: tuple
    true_shape: tuple | None = None


def per_value(starts, ids, n):
    """The block of each of n values from runs."""
    return np.repeat(ids, np.diff(np.append(starts, n))).tolist()


def test_column_slices_of_3x5_meet_blocks_of_4():
    """A 3x5 tensor, blocks of 4 of its row-major elements: b0 = 0-3, b1 = 4-7, b2 = 8-11, b3 = 12-14. Columns 0-2
    (rank 0) hold elements 0 1 2 | 5 6 7 | 10 11 12, columns 3-4 (rank 1) hold 3 4 | 8 9 | 13 14; so block 0 is
    rank 0's first three values and rank 1's first, block 1 rank 0's next three and rank 1's second, ..."""
    spec = Spec((3, 5))
    real, starts, ids = blocks.piece_runs(spec, (slice(0, 3), slice(0, 3)), 0, 9, 4)
    assert real is None and starts.tolist() == [0, 3, 6, 8] and ids.tolist() == [0, 1, 2, 3]
    assert per_value(starts, ids, 9) == [0, 0, 0, 1, 1, 1, 2, 2, 3]
    real, starts, ids = blocks.piece_runs(spec, (slice(0, 3), slice(3, 5)), 0, 6, 4)
    assert real is None and starts.tolist() == [0, 1, 2, 4] and ids.tolist() == [0, 1, 2, 3]
    assert per_value(starts, ids, 6) == [0, 1, 2, 2, 3, 3]
    # a piece of rank 0's slice (a sharding cut inside it): local values 4-7 are elements 6 7 10 11
    _, starts, ids = blocks.piece_runs(spec, (slice(0, 3), slice(0, 3)), 4, 8, 4)
    assert per_value(starts, ids, 4) == [1, 1, 2, 2]
    assert blocks.tensor_blocks(spec, 4) == 4


def test_padding_is_left_out():
    """A (2, 4) tensor padded to (2, 6) for tp 2 (true shape (2, 4)): rank 1 holds padded columns 3-5, of which
    only column 3 is real (elements 3 and 7 of the unpadded tensor, blocks 0 and 1 of 4)."""
    spec = Spec((2, 6), (2, 4))
    real, starts, ids = blocks.piece_runs(spec, (slice(0, 2), slice(3, 6)), 0, 6, 4)
    assert real.tolist() == [0, 3] and starts.tolist() == [0, 1] and ids.tolist() == [0, 1]


def rounded(v, levels, block=quantize.BLOCK):
    """v (a whole tensor, flat) in blocks from its start, scale max|x| / levels as float32, round half to even."""
    n = v.size
    x = np.zeros(-(-n // block) * block)
    x[:n] = v
    x = x.reshape(-1, block)
    scale = (np.abs(x).max(axis=1) / levels).astype(np.float32).astype(np.float64)
    q = np.clip(np.rint(x / np.where(scale > 0, scale, 1.0)[:, None]), -levels, levels)
    return (q * scale[:, None]).reshape(-1)[:n]


class TwoRanks:
    """The scales' MAX over two tp ranks run one after another: each rank's calls in order, a first pass recording
    each vector, a second (again(), the same calls) handing back the element-wise maximum of the two ranks'."""

    def __init__(self):
        self.seen, self.calls = {0: [], 1: []}, {0: 0, 1: 0}
        self.final = False

    def maxed(self, rank):
        def call(a):
            if self.final:
                a[...] = np.maximum(self.seen[0][self.calls[rank]], self.seen[1][self.calls[rank]])
            else:
                self.seen[rank].append(a.copy())
            self.calls[rank] += 1
        return call

    def again(self):
        self.final, self.calls = True, {0: 0, 1: 0}


@pytest.mark.parametrize("fmt,levels", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("shape,cols", [((24, 40), 24), ((7, 100), 50), ((50, 3), 2)])
def test_two_tp_ranks_of_two_islands_round_as_one_process(fmt, levels, shape, cols):
    """Two islands, each a tensor split by columns over two tp ranks: each rank's payload decoded by the other
    island's rank of the same slice, averaged, re-quantised with the MAX of the slices' scales, gathered and decoded,
    gives each slice of the whole tensor's twice-rounded mean (the islands' rounded values summed, over 2, rounded)."""
    rng = np.random.default_rng(cols)
    R, C = shape
    whole = [rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, shape) for _ in range(2)]
    boxes = [(slice(0, R), slice(0, cols)), (slice(0, R), slice(cols, C))]
    G = blocks.tensor_blocks(Spec(shape), quantize.BLOCK)
    wires = [quantize.Wire(blocks.fragment_plan([(Spec(shape), b, 0, R * (b[1].stop - b[1].start), 0)], G,
                                                quantize.BLOCK), 2, fmt) for b in boxes]
    mx = TwoRanks()          # phase 1: every island's ranks encode their slices
    for _ in range(2):
        sent = {(i, t): quantize.encode(np, whole[i][boxes[t]].reshape(-1), wires[t], mx.maxed(t))
                for i in range(2) for t in range(2)}
        mx.again()
    mx, mine = TwoRanks(), {}       # island j, tp rank t: its chunk of the mean, from both islands' chunk j
    for _ in range(2):
        for j in range(2):
            for t in range(2):
                counts = sent[0, t][2]
                at = sum(counts[:j])
                got = np.concatenate([sent[i, t][0][at:at + counts[j]] for i in range(2)])
                mine[j, t] = quantize.mean_chunk(np, got, wires[t], j, np.float64, mx.maxed(t))
        mx.again()
    first = [rounded(w.reshape(-1), levels).reshape(shape) for w in whole]
    want = rounded(((first[0] + first[1]) / 2).reshape(-1), levels).reshape(shape)
    for t in range(2):
        for i in range(2):
            assert np.array_equal(sent[i, t][1], first[i][boxes[t]].reshape(-1))
        mean = quantize.decode(np, np.concatenate([mine[0, t], mine[1, t]]), wires[t], np.float64)
        assert np.array_equal(mean, want[boxes[t]].reshape(-1))
