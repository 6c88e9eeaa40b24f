"""Which ranks read a step's rows and how the others get them: only the pipeline stages that compute on rows
(the first chunk's tokens, the last chunk's targets) read, one rank of each tensor-parallel group, which
broadcasts the Batch; a stage in between holds a Batch of only its shape, or (document_mask) its rows'
documents, from the offsets every rank holds. Each cp rank then keeps its head-tail part of every field.
"""
from __future__ import annotations

import numpy as np

from hpengine.data.batch import Batch


class RowReader:
    """This rank's rows of a global batch. data: the TokenDataset; share: rows per replica; start: the
    replica's first row; reads: whether this rank's pipeline stage computes on rows (PipelineExecutor.reads_rows);
    tp: the tensor-parallel Comm; cp, cp_rank: the context-parallel degree and this rank's place in it; ahead: the
    multi-token prediction depth whose targets the training rows bring (Batch.with_ahead), 0 for none."""

    def __init__(self, data, backend, global_batch: int, seq_len: int, share: int, start: int, reads: bool, tp,
                 cp: int = 1, cp_rank: int = 0, ahead: int = 0):
        self.data, self.be, self.global_batch, self.seq_len = data, backend, global_batch, seq_len
        self.share, self.start, self.reads, self.tp, self.cp, self.cp_rank = share, start, reads, tp, cp, cp_rank
        self.ahead = ahead

    def read(self, split: str, step: int, seed: int) -> Batch:
        """This rank's rows of the global batch of `step` (the cp ranks of a replica take the same rows), on
        the device; under context parallelism its head-tail part of every sequence. Training rows bring the targets
        of multi-token prediction too, made on whole rows before any split."""
        read = lambda tokens=True: self.data.batch(split, step, seed, self.global_batch, start=self.start,  # noqa: E731
                                                   count=self.share, tokens=tokens)
        depth = self.ahead if split == "train" else 0
        return self.shared(lambda: read().with_ahead(depth), self.share, self.seq_len, lambda: read(tokens=False))

    def norm(self, split: str, step: int, seed: int) -> float:
        """The loss divisor of the global batch of `step`: its counted targets (the same on every rank); 1 when
        the mask counts none (documents of one token each), whose loss and gradients are then 0, not NaN."""
        return float(max(1, self.data.counted(split, step, seed, self.global_batch)))

    def ahead_norms(self, split: str, step: int, seed: int) -> tuple:
        """The loss divisors of multi-token prediction's depths 1 .. ahead in the global batch of `step`, each its
        counted targets (at least 1, as norm's)."""
        return tuple(float(max(1, self.data.counted(split, step, seed, self.global_batch, k)))
                     for k in range(1, self.ahead + 1))

    def shared(self, read, rows: int, T: int, documents=None) -> Batch:
        """The Batch `read()` returns, read by tp rank 0 of a stage that computes on rows and broadcast to the
        rest of its tp group; on a stage that does not, `documents()` (the rows' documents only, no tokens)
        or Batch.empty(rows, T) (whose wire shapes still come from it); split for context parallelism and
        moved to the device."""
        if not self.reads:
            batch = Batch.empty(rows, T) if documents is None else documents()
        elif self.tp.size == 1:
            batch = read()
        else:
            batch = self._broadcast(read if self.tp.rank == 0 else None)
        return batch.split_sequence(self.cp, self.cp_rank).to_device(self.be.to_device)

    def _broadcast(self, read) -> Batch:
        """tp rank 0 reads; what it read (or the error it met, raised on every rank alike) goes to the group."""
        head, batch = None, None
        if read is not None:
            try:
                batch = read()
                head = (batch.shape, [(f, a.dtype.str, a.shape) for f, a in batch.present().items()])
            except Exception as e:      # noqa: BLE001 - re-raised below, on every rank of the group
                head = e
        head = self.tp.bcast_obj(head, root=0)
        if isinstance(head, Exception):
            raise head
        shape, present = head
        arrays = {}
        for f, dtype, fshape in present:
            a = batch.present()[f] if batch is not None else np.empty(fshape, dtype=np.dtype(dtype))
            a = np.ascontiguousarray(a)
            # the raw communicator: input rows are not the model traffic the planner's figures count
            self.tp.c.Bcast(a, root=0)
            arrays[f] = a
        return Batch(**arrays, shape=shape)
