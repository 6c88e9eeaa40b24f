"""Expert parallel: the context part (models/context.py LocalEP) that sends each routed row to the rank holding
its expert and the expert's output back, over the `ep` communicator (experts split into ep equal blocks of
consecutive experts, folded inside the data-parallel ranks: Mesh.fold).
"""
from __future__ import annotations

import numpy as np

from hpengine.models.context import LocalEP


# A rank hands over its rows sorted by expert (nn/moe.moe_permute), so the rows for rank d's experts are one
# consecutive block; the counts per (source, local expert) go first (a small all-to-all), then the rows
# (MPI_Alltoallv). A rank receives its rows by source, each source's by local expert, and regroups them by
# local expert, source after source: expert e's GEMM meets the rows of the ep ranks' sequences in rank
# order, which is the order of the global batch. The way back undoes both steps.
class ExpertParallel(LocalEP):
    def __init__(self, comm, xp):
        self.comm, self.xp = comm, xp
        self.rank, self.size = comm.rank, comm.size

    def dispatch(self, xs, counts):
        # xs: (S, C) this rank's rows sorted by expert, counts: (E,) rows per expert
        # -> (rows of this rank's experts grouped by local expert (S', C), their counts (E / ep,), plan)
        xp = self.xp
        c = np.asarray(counts.get() if hasattr(counts, "get") else counts, dtype=np.int64)
        n = self.size
        per = c.reshape(n, -1)                             # [dest][its local expert]
        got = np.array(self.comm.alltoall_obj([row.tolist() for row in per]), dtype=np.int64)  # [src][local]
        send_rows, recv_rows = per.sum(axis=1), got.sum(axis=1)
        recv = xp.empty((int(recv_rows.sum()),) + tuple(xs.shape[1:]), dtype=xs.dtype)
        self.comm.alltoallv_(xp.ascontiguousarray(xs), send_rows, recv, recv_rows)
        # received: by source, then by local expert; wanted: by local expert, then by source
        start = np.concatenate([[0], np.cumsum(got.reshape(-1))])[:-1].reshape(got.shape)
        perm = np.concatenate([np.arange(start[s, e], start[s, e] + got[s, e]) for e in range(got.shape[1])
                               for s in range(n)]).astype(np.int64) if got.size else np.zeros(0, np.int64)
        perm = xp.asarray(perm)
        plan = (send_rows, recv_rows, perm)
        return recv[perm], xp.asarray(got.sum(axis=0)), plan

    def _back(self, ys, plan):
        # ys: (S', C) grouped by local expert -> (S, C) at the sender, in its order
        send_rows, recv_rows, perm = plan
        xp = self.xp
        by_source = xp.empty_like(ys)
        by_source[perm] = ys
        out = xp.empty((int(send_rows.sum()),) + tuple(ys.shape[1:]), dtype=ys.dtype)
        return self.comm.alltoallv_(by_source, recv_rows, out, send_rows)

    def _forth(self, xs, plan):
        # xs: (S, C) in this rank's order -> (S', C) grouped by local expert at the experts' ranks
        send_rows, recv_rows, perm = plan
        xp = self.xp
        recv = xp.empty((int(recv_rows.sum()),) + tuple(xs.shape[1:]), dtype=xs.dtype)
        self.comm.alltoallv_(xp.ascontiguousarray(xs), send_rows, recv, recv_rows)
        return recv[perm]

    def dispatch_backward(self, dxs, plan):
        return self._back(dxs, plan)

    def combine(self, ys, plan):
        return self._back(ys, plan)

    def combine_backward(self, dys, plan):
        return self._forth(dys, plan)
