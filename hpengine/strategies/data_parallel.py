"""Data parallel: full replicas; gradients summed across the dp group in buckets whose non-blocking
allreduce starts as soon as backward has finished every block in the bucket.
"""
from __future__ import annotations

import time

import numpy as np

from hpengine.dist.comm import testall, waitall
from hpengine.params.buffers import Range
from hpengine.strategies.base import LocalSync, Wires
from hpengine.strategies.grad_storage import PLAIN


def make_buckets(done_order, block_ranges, cap_bytes, itemsize):
    """Group blocks, in the order backward finishes them, into contiguous buckets of ~cap_bytes."""
    buckets, cur, blocks = [], None, []
    for b in done_order:
        r = block_ranges.get(b)
        if r is None:
            continue
        if cur is not None and r.stop == cur.start and cur.size * itemsize < cap_bytes:
            cur, blocks = Range(r.start, cur.stop), blocks + [b]
        else:
            if cur is not None:
                buckets.append((cur, blocks))
            cur, blocks = r, [b]
    if cur is not None:
        buckets.append((cur, blocks))
    return buckets


def segments(r: Range, experts, dp, ep_dp) -> list:
    """(range, communicator) pieces of bucket range r: the expert blocks split over ep are summed over
    their replicas only (ep_dp; nothing to do with one), everything else over dp."""
    out, at = [], r.start
    for e in sorted(experts, key=lambda x: x.start):
        hit = e.intersect(r)
        if hit is None:
            continue
        if hit.start > at:
            out.append((Range(at, hit.start), dp))
        if ep_dp is not None and ep_dp.size > 1:
            out.append((hit, ep_dp))
        at = hit.stop
    if at < r.stop:
        out.append((Range(at, r.stop), dp))
    return out


# The loss is normalised by the global token count, so the sum over replicas is already the mean
# gradient of the global batch (the seed's "sum divided by n" with the 1/n folded into the loss). Encoded
# gradients (grad_storage.py) are summed as float32 wire copies of each bucket, encoded back when their sum
# completes.
class DataParallelSync(LocalSync):
    def __init__(self, stage, backend, dp_comm, bucket_mb: float, ep_dp=None, storage=PLAIN):
        super().__init__(stage, backend, storage)
        self.dp = dp_comm
        cap = int(bucket_mb * 2**20)
        self.buckets = make_buckets(stage.done_order, stage.block_ranges, cap, self.dtype.itemsize)
        self.bucket_of = {b: i for i, (_, bs) in enumerate(self.buckets) for b in bs}
        lay = stage.layout
        experts = lay.expert_ranges()
        self.ep_dp = ep_dp
        self.pieces = [segments(r, experts, dp_comm, ep_dp) for r, _ in self.buckets]
        self.reqs, self.remaining = [], {}
        self.wires = Wires(self)
        self.wait_s = self.sync_s = 0.0

    def begin_step(self):
        super().begin_step()
        self.reqs = []
        self.wires = Wires(self)
        self.remaining = {i: len(bs) for i, (_, bs) in enumerate(self.buckets)}

    def _reduce_block(self, block):
        if not self.last or block not in self.bucket_of:
            return
        i = self.bucket_of[block]
        self.remaining[i] -= 1
        if self.remaining[i] == 0:
            t = time.perf_counter()
            if self.storage.encoded:
                self._closed(self.buckets[i][1])
            for r, comm in self.pieces[i]:
                if self.storage.encoded:
                    self._reduce_on_wire(r, comm)
                else:
                    self.reqs.append(comm.iallreduce_(self.grads.data[r.slice]))
            self.sync_s += time.perf_counter() - t
        testall(self.reqs)
        self.wires.progress()

    def _reduce_on_wire(self, r, comm):
        stored = self.grads.data[r.slice]
        wire = self.storage.decode(self.xp, stored)
        self.wires.add([comm.iallreduce_(wire)], [wire], lambda: self.storage.encode(self.xp, wire, stored))

    def reduce_grads(self):
        t = time.perf_counter()
        waitall(self.reqs)
        self.wires.wait()
        dt = time.perf_counter() - t
        self.wait_s += dt
        self.sync_s += dt
        self.reqs = []
        if self.storage.encoded:
            return self._update_grad(self.grads.data)
        # every piece's sum, stored (a piece not summed was stored so already)
        self.storage.round_(self.xp, self.grads.data)
        return self.grads.data

    def loss_allreduce(self, losses):
        return list(self.dp.allreduce_(np.array(losses, dtype=np.float64)))

    def comm_names(self) -> dict:
        return {"grads": [self.dp.name] + ([self.ep_dp.name] if self.ep_dp is not None else []), "params": []}
