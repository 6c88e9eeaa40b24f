"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"): between the tensor-parallel regions each tp rank holds 1/t of every sequence, so the norms,
residuals and what they cache are split t ways instead of repeated on every rank.
"""
from __future__ import annotations

import numpy as np

from hpengine.nn.linear import linear_drop_input, linear_restore_input
from hpengine.strategies.tensor_parallel import TensorParallel, TensorParallelSeq


# Activations are (B, T, C) arrays; the sequence is axis 1, cut into t contiguous pieces in rank order.
def gather_sequence(comm, x):
    """(B, T/t, C) on each rank of comm -> (B, T, C) everywhere."""
    B, n, C = x.shape
    return comm.allgather_axis1(np.ascontiguousarray(x), np.empty_like(x, shape=(B, comm.size * n, C)))


def scatter_sum_sequence(comm, x):
    """(B, T, C) partial sums on each rank of comm -> this rank's (B, T/t, C) piece of their sum."""
    B, T, C = x.shape
    n = T // comm.size
    pieces = np.ascontiguousarray(x.reshape(B, comm.size, n, C).transpose(1, 0, 2, 3))
    out = np.empty_like(x, shape=(B, n, C))
    return comm.reduce_scatter(pieces, out)


# Two parts of the context change. The tp part (SequenceParallel) keeps the pairs' names: copy_to_tp (a
# region's entry) all-gathers the sequence forward and reduce-scatters back; reduce_from_tp (its exit)
# reduce-scatters forward and all-gathers back.
class SequenceParallel(TensorParallel):
    """The tp part under sequence parallelism: TensorParallel whose pairs gather and scatter the sequence."""

    def copy_to_tp(self, x):
        return gather_sequence(self.comm, x)

    def copy_to_tp_backward(self, dx):
        return scatter_sum_sequence(self.comm, dx)

    def reduce_from_tp(self, x):
        return scatter_sum_sequence(self.comm, x)

    def reduce_from_tp_backward(self, dx):
        return gather_sequence(self.comm, dx)


# The seq part (SequenceSplit) names this rank's positions,
# keeps only this rank's piece of a region-entry linear's input (stash_inputs; gathered again in backward,
# as Megatron does) and sums over tp, once a step, the gradients of the tensors every tp rank holds whole
# (norm weights, biases after a reduce, the position table), which now see only this rank's positions.
class SequenceSplit(TensorParallelSeq):
    """The seq part under sequence parallelism: this tp rank holds piece `comm.rank` of `comm.size` of
    every sequence (comm: the tp communicator, which the gathers of stashed inputs and the once-a-step sum of
    the replicated tensors' gradients, TensorParallelSeq's, run on)."""

    def __init__(self, comm):
        super().__init__(comm)
        self.rank, self.parts = comm.rank, comm.size

    def local_positions(self, n: int) -> slice:
        return slice(self.rank * n, (self.rank + 1) * n)

    def stash_inputs(self, x, *caches):
        # the gathered input is dropped from every cache; this rank's piece x is kept instead
        return (x,) + tuple(linear_drop_input(c) for c in caches)

    def unstash_inputs(self, stash):
        full = gather_sequence(self.comm, stash[0])
        return tuple(linear_restore_input(c, full) for c in stash[1:])

    def stashed_caches(self, stash):
        # without their inputs: no gather
        return stash[1:]
