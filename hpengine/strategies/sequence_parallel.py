"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"): between the tensor-parallel regions each tp rank holds 1/t of every sequence, so the norms,
residuals and what they cache are split t ways instead of repeated on every rank.

The conjugate pairs a block is handed change their collectives and keep their names:
- copy_to_tp (a region's entry) all-gathers the sequence forward and reduce-scatters its gradient back;
- reduce_from_tp (a region's exit) reduce-scatters the partial sums forward and all-gathers backward.
A column-split linear at a region's entry keeps only this rank's piece of its input (stash_inputs) and
gathers it again in backward, so its cache is split too (Megatron does the same).

Activations are (B, T, C) arrays; the sequence is axis 1, cut into t contiguous pieces in rank order.
The tensors every tp rank holds whole (norm weights, biases after a reduce, the position table) now see
only this rank's positions, so their gradients are summed over tp once a step (sum_replicated_).
"""
from __future__ import annotations

import numpy as np

from hpengine.nn.linear import linear_drop_input, linear_restore_input
from hpengine.strategies.tensor_parallel import TensorParallel


class SequenceParallel(TensorParallel):
    """TensorParallel with the activations outside the tp regions split along the sequence."""

    @property
    def seq_parts(self) -> int:
        return self.size

    def _gather(self, x):
        """(B, T/t, C) on each rank -> (B, T, C) everywhere."""
        B, n, C = x.shape
        return self.comm.allgather_axis1(np.ascontiguousarray(x), np.empty_like(x, shape=(B, self.size * n, C)))

    def _scatter_sum(self, x):
        """(B, T, C) partial sums on each rank -> this rank's (B, T/t, C) piece of their sum."""
        B, T, C = x.shape
        n = T // self.size
        pieces = np.ascontiguousarray(x.reshape(B, self.size, n, C).transpose(1, 0, 2, 3))
        out = np.empty_like(x, shape=(B, n, C))
        return self.comm.reduce_scatter(pieces, out)

    def copy_to_tp(self, x):
        return self._gather(x)

    def copy_to_tp_backward(self, dx):
        return self._scatter_sum(dx)

    def reduce_from_tp(self, x):
        return self._scatter_sum(x)

    def reduce_from_tp_backward(self, dx):
        return self._gather(dx)

    def local_positions(self, n: int) -> slice:
        return slice(self.rank * n, (self.rank + 1) * n)

    def stash_inputs(self, x, *caches):
        # the gathered input is dropped from every cache; this rank's piece x is kept instead
        return (x,) + tuple(linear_drop_input(c) for c in caches)

    def unstash_inputs(self, stash):
        full = self._gather(stash[0])
        return tuple(linear_restore_input(c, full) for c in stash[1:])

    def sum_replicated_(self, g, ranges) -> None:
        """Sum over tp the gradient slices g[a:b] of the replicated tensors, in one allreduce."""
        if not ranges:
            return
        parts = [g[a:b] for a, b in ranges]
        buf = np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
        self.comm.allreduce_(buf)
        at = 0
        for p in parts:
            p[...] = buf[at:at + p.size]
            at += p.size
