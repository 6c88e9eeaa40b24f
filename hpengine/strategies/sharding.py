"""Sharding (ZeRO stages 1-3) over the element-count partition of CN115114927A: each sharding rank owns
one Range of the stage's flat buffer, gets its gradient reduced to it, runs the optimizer on it and shares
the result; stage 2 keeps only the owned gradient, stage 3 only the owned parameters too.
"""
from __future__ import annotations

import time

import numpy as np

from hpengine.dist.comm import testall, waitall
from hpengine.layout.resolve import MAX_INFLIGHT
from hpengine.params.buffers import FlatBuffer, Range, cut, imbalance, partition
from hpengine.params.init import init_parts
from hpengine.strategies.base import LocalSync, Merged, Wires
from hpengine.strategies.data_parallel import segments
from hpengine.strategies.grad_storage import PLAIN
from hpengine.strategies.whole_experts import ExpertsWhole


# The stage's flat buffer is cut into one Range per sharding rank ("tensor": whole tensors, balanced by
# element count; "flat": equal ranges). Each finished block's gradient is reduced straight to the owners
# of its parts; an owner then averages across dp, runs the optimizer on its range and shares the result.
# Stage 1 keeps full gradients and parameters, stage 2 only the owned gradient, stage 3 only the owned
# parameters too (a block's parameters are gathered just in time, the next block's prefetched). The parameters
# held and gathered are in the storage's form (grad_storage.py; bfloat16 bits: the all-gathers move 2 bytes a
# parameter); encoded gradients (the full buffer, the per-block temporaries at rest between passes, the owned
# shard) are reduced through float32 wire copies. With expert parallel across the sharding ranks (whole_experts.py)
# a rank owns several ranges: its share less the experts, and its whole expert block, summed over ep-dp.
class ShardedSync(LocalSync):
    def __init__(self, desc, backend, sh_comm, dp_comm, stage: int, mode: str, ep_dp=None, storage=PLAIN,
                 experts_whole: bool = False):
        lay = desc.layout
        self.sh, self.dp, self.stage, self.mode, self.ep_dp = sh_comm, dp_comm, stage, mode, ep_dp
        self.ranges = partition([lay.ranges[n].size for n in lay.names], sh_comm.size, mode)
        super().__init__(desc, backend, storage, full_grads=stage == 1, full_params=stage < 3)
        own = self.ranges[sh_comm.rank]
        experts = lay.expert_ranges()
        # experts_whole (ep across sharding ranks, whole_experts.py): the sharding ranks hold different experts,
        # so each keeps its expert block whole (summed over ep-dp) besides its share of the rest
        self.xw = ExpertsWhole(experts, own, desc.block_ranges) if experts_whole else None
        self.owned = None if self.xw else own
        self.owned_parts = self.xw.parts if self.xw else [(own, 0)]
        size = sum(r.size for r, _ in self.owned_parts)
        # the owned range's pieces and the replicas each is averaged over: expert blocks split over ep (a
        # sharding group holds one ep rank's experts) over their replicas only, everything else over dp
        self.pieces = (self.xw.dense_pieces(dp_comm) if self.xw else
                       [(Range(r.start - own.start, r.stop - own.start), c)
                        for r, c in segments(own, experts, dp_comm, ep_dp) if c.size > 1])
        self.imbalance = imbalance(self.ranges)
        self.parts = {b: [(r, p) for r, R in enumerate(self.ranges) if (p := br.intersect(R))]
                      for b, br in desc.block_ranges.items()}
        if self.xw:
            self.parts = self.xw.dense_parts(self.parts)
        if stage >= 2:
            self.gshard = self.xp.zeros(size, dtype=self.grad_dtype)
        if stage == 3:
            self.pshard = init_parts(lay, desc.seed, self.owned_parts, self.xp, self.dtype)
        self.pown = None        # experts_whole, stages 1-2: the owned parameters packed, written back on share
        self.after = {}         # experts_whole, stages 2-3: block -> (summed expert gradient, owned slot) copies
        self.gtemp, self.inflight, self.gathered = {}, [], {}
        self.wires = Wires(self)
        self.wait_s = self.sync_s = 0.0

    def _slot(self, p):
        """Where flat Range p (inside one owned part) sits in the owned arrays (gshard, pshard, the update's)."""
        hit, at = cut(self.owned_parts, p)[0]
        return slice(at, at + p.size)

    def _owned_of(self, full):
        """The owned parts of a full flat array: a view of the one range, or the parts packed (a copy)."""
        if self.xw is None:
            return full[self.owned.slice]
        return self.xp.concatenate([full[r.slice] for r, _ in self.owned_parts])

    # --- gradients --------------------------------------------------------------------------------
    def _gtemp(self, b):
        if b not in self.gtemp:
            self.gtemp[b] = FlatBuffer(self.block_layouts[b], self.xp, self.grad_dtype)
            self._track(self.gtemp[b].data.nbytes)
        return self.gtemp[b]

    @property
    def grad_dtype(self):
        return self.storage.grad_dtype(self.dtype)

    def _grads_view(self, block):
        if self.stage == 1:
            return self.grads
        bufs = [self._gtemp(b) for b in [block] + list(self.deps.get(block, ()))]
        return bufs[0] if len(bufs) == 1 else Merged(bufs)

    def _stored(self, b):
        return super()._stored(b) if self.stage == 1 else self._gtemp(b).data

    def begin_step(self):
        self._finish_gathers()
        self._end_update_grad()
        self.wires = Wires(self)
        if self.stage == 1:
            self.grads.zero()

    def _reduce_block(self, block):
        if not self.last or block not in self.parts:
            return
        t0 = time.perf_counter()
        if self.storage.encoded:
            self._reduce_on_wire(block)
        else:
            self._reduce_f32(block)
        self.sync_s += time.perf_counter() - t0

    def _reduce_on_wire(self, block):
        """Each part of the block's encoded gradients to its owner through float32 wires; the owner encodes the
        sum into its stored gradient (the full buffer's owned range, or gshard) when it completes."""
        br, xp, st = self.block_ranges[block], self.xp, self.storage
        self._closed([block])
        if self.stage == 1:
            stored = self.grads.data[br.slice]
        else:
            buf = self.gtemp.pop(block)      # its last pass is over: the wire replaces the stored form
            self.transient -= buf.data.nbytes
            stored = buf.data
        wire = st.decode(xp, stored)
        reqs, mine = [], []
        for r, p in self.parts[block]:
            src = wire[p.start - br.start:p.stop - br.start]
            reqs.append(self.sh.ireduce(src, src, root=r))
            if r == self.sh.rank:
                mine.append((src, self.grads.data[p.slice] if self.stage == 1 else self.gshard[self._slot(p)]))
        for x, at in (self.xw.block_experts(block) if self.xw else ()):   # whole experts: summed over ep-dp
            src = wire[x.start - br.start:x.stop - br.start]
            if self.ep_dp.size > 1:
                reqs.append(self.ep_dp.iallreduce_(src))
            mine.append((src, self.grads.data[x.slice] if self.stage == 1 else self.gshard[at:at + x.size]))

        def done():
            for a, b in mine:
                st.encode(xp, a, b)
        self.wires.add(reqs, [wire], done)

    def _reduce_f32(self, block):
        br = self.block_ranges[block]
        reqs = []
        for r, p in self.parts[block]:
            if self.stage == 1:
                buf = self.grads.data[p.slice]
                reqs.append(self.sh.ireduce(buf, buf, root=r))
            else:
                src = self.gtemp[block].data[p.start - br.start:p.stop - br.start]
                dst = self.gshard[self._slot(p)] if r == self.sh.rank else None
                reqs.append(self.sh.ireduce(src, dst, root=r))
        for x, at in (self.xw.block_experts(block) if self.xw else ()):   # whole experts: summed over ep-dp
            buf = self.grads.data[x.slice] if self.stage == 1 else self.gtemp[block].data[x.start - br.start:x.stop - br.start]
            if self.ep_dp.size > 1:
                reqs.append(self.ep_dp.iallreduce_(buf))
            if self.stage > 1:      # into the owned gradient once the sum is complete (_free_gtemp)
                self.after.setdefault(block, []).append((buf, self.gshard[at:at + x.size]))
        self.inflight.append((reqs, block))
        self._progress()
        while self.stage >= 2 and len(self.inflight) > MAX_INFLIGHT:   # bound the temporary gradients
            old_reqs, old_block = self.inflight.pop(0)
            waitall(old_reqs)
            self._free_gtemp(old_block)

    def _progress(self):
        """Advance the reductions in flight; free the temporary gradients of finished blocks."""
        keep = []
        for reqs, b in self.inflight:
            if testall(reqs):
                self._free_gtemp(b)
            else:
                keep.append((reqs, b))
        self.inflight = keep

    def _free_gtemp(self, b):
        for src, dst in self.after.pop(b, ()):
            dst[...] = src
        buf = self.gtemp.pop(b, None)
        if buf is not None:
            self.transient -= buf.data.nbytes

    def reduce_grads(self):
        t0 = time.perf_counter()
        for reqs, b in self.inflight:
            waitall(reqs)
            self._free_gtemp(b)
        self.inflight = []
        self.wires.wait()
        g = self._owned_of(self.grads.data) if self.stage == 1 else self.gshard
        if self.storage.encoded:    # each owner sum is encoded already (rounded)
            g = self._update_grad(g)
        else:                       # the owners' sums, stored
            self.storage.round_(self.xp, g)
        for r, comm in self.pieces:     # owners of the same range in different replicas average it
            comm.allreduce_(g[r.slice])
            self.storage.round_(self.xp, g[r.slice])
        self.wait_s += time.perf_counter() - t0
        self.sync_s += time.perf_counter() - t0
        return g

    def loss_allreduce(self, losses):
        v = self.sh.allreduce_(np.array(losses, dtype=np.float64))
        return list(self.dp.allreduce_(v))

    # --- parameters -------------------------------------------------------------------------------
    def owned_params(self):
        if self.stage == 3:
            return self.pshard
        if self.xw is None:
            return self.params.data[self.owned.slice]
        self._drop_pown()
        self.pown = self._owned_of(self.params.data)    # what the update writes; share_params writes it back
        self._track(self.pown.nbytes)
        return self.pown

    def _drop_pown(self):
        if self.pown is not None:
            self.transient -= self.pown.nbytes
            self.pown = None

    def share_params(self):
        if self.stage == 3:
            self._finish_gathers()   # gathered copies predate this update
        else:
            if self.xw is not None and self.pown is not None:   # what the update wrote, before it is shared
                for r, at in self.owned_parts:
                    self.params.data[r.slice] = self.pown[at:at + r.size]
                self._drop_pown()
            counts = [r.size for r in self.ranges]
            displs = [r.start for r in self.ranges]
            keep = [self.params.data[x.slice].copy() for x in self.xw.experts] if self.xw is not None else ()
            self._track(sum(int(k.nbytes) for k in keep))
            self.sh.allgatherv_(self.params.data, counts, displs)
            for x, vals in zip(self.xw.experts if self.xw is not None else (), keep):
                self.params.data[x.slice] = vals    # this rank's experts, where other shares brought theirs
            self.transient -= sum(int(k.nbytes) for k in keep)

    def store_params(self) -> None:
        changes = self.storage.param_dtype(self.dtype) != self.param_dtype
        super().store_params()
        if changes and self.stage == 3:
            self.pshard = self.storage.params(self.xp, self.pshard)

    def _start_gather(self, b):
        br = self.block_ranges[b]
        buf = FlatBuffer(self.block_layouts[b], self.xp, self.param_dtype)
        for mine, at in cut(self.owned_parts, br):
            buf.data[mine.start - br.start:mine.stop - br.start] = self.pshard[at:at + mine.size]
        cuts = [R.intersect(br) for R in self.ranges]
        counts = [c.size if c else 0 for c in cuts]
        displs = [c.start - br.start if c else 0 for c in cuts]
        self.gathered[b] = (buf, self.sh.iallgatherv_(buf.data, counts, displs))
        self._track(buf.data.nbytes)

    def params_for(self, block, nxt=None):
        if self.stage < 3:
            return self.params
        need = [block] + list(self.deps.get(block, ()))
        for b in need:
            if b not in self.gathered:
                self._start_gather(b)
        waitall([self.gathered[b][1] for b in need])
        for b in need if self.xw else ():     # whole experts: this rank's own, over the other shares' experts
            buf, br = self.gathered[b][0], self.block_ranges[b]
            for x, at in self.xw.block_experts(b):
                buf.data[x.start - br.start:x.stop - br.start] = self.pshard[at:at + x.size]
        if nxt is not None and nxt not in self.gathered:
            self._start_gather(nxt)   # prefetch: overlaps the next block's gather with this compute
        bufs = [self.gathered[b][0] for b in need]
        return bufs[0] if len(bufs) == 1 else Merged(bufs)

    def param_roots(self) -> set:
        return super().param_roots() | {id(buf.data) for buf, _ in self.gathered.values()}

    def release(self, block):
        if self.stage < 3:
            return
        for b in [block] + list(self.deps.get(block, ())):
            item = self.gathered.pop(b, None)
            if item is not None:
                # always complete and drop it: whether a request has finished differs between ranks, so
                # deciding on Test() could make ranks issue different gathers later
                waitall([item[1]])
                self.transient -= item[0].data.nbytes

    def _finish_gathers(self):
        waitall([req for _, req in self.gathered.values()])
        for buf, _ in self.gathered.values():
            self.transient -= buf.data.nbytes
        self.gathered = {}

    def full_params(self) -> np.ndarray:
        if self.stage < 3:
            return super().full_params()
        full = self.xp.zeros(self.layout.total, dtype=self.param_dtype)
        for r, at in self.owned_parts:
            full[r.slice] = self.pshard[at:at + r.size]
        self.sh.allgatherv_(full, [r.size for r in self.ranges], [r.start for r in self.ranges])
        for r, at in self.owned_parts if self.xw else ():
            full[r.slice] = self.pshard[at:at + r.size]
        return self.storage.param_values(np, self.be.to_host(full))

    def param_bytes(self) -> int:
        return int(self.pshard.nbytes if self.stage == 3 else self.params.data.nbytes)

    def grad_bytes(self) -> int:
        return int(self.grads.data.nbytes if self.stage == 1 else self.gshard.nbytes)

    def comm_names(self) -> dict:
        comms = (self.sh, self.dp) + ((self.ep_dp,) if self.ep_dp is not None else ())
        return {"grads": [c.name for c in comms if c.size > 1], "params": [self.sh.name]}

    def describe(self) -> str:
        sizes = [r.size for r in self.ranges]
        line = (f"sharding stage {self.stage}, partition {self.mode}: {len(sizes)} owners, shares {sizes} elements, "
                f"bytes imbalance {self.imbalance:.3f}")
        if self.xw is not None:
            line += f"; this rank's expert block ({sum(x.size for x in self.xw.experts)} elements) kept whole"
        more = super().describe()       # an optimizer's whole-tensor work: its own owners, balanced by work
        return f"{line}; {more}" if more else line
