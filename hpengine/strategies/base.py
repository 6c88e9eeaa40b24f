"""The GradSync interface between the engine and the strategies that hold parameters and gradients,
and LocalSync, its one-replica form: full parameter and gradient buffers, the whole range owned. How values
are stored is the storage policy's (grad_storage.py): a sync stores each sum through it and, when gradients
rest encoded, hands the layers a float32 scratch per open block (grads_for ... grads_done).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from hpengine.dist.comm import testall, waitall
from hpengine.layout.resolve import MAX_INFLIGHT
from hpengine.params.buffers import FlatBuffer, Layout, Range
from hpengine.params.init import init_flat
from hpengine.strategies.grad_storage import PLAIN


class Merged:
    """Name lookup over several buffers (a block plus the blocks it also reads)."""

    def __init__(self, bufs):
        self.bufs = bufs

    def _find(self, name):
        for b in self.bufs:
            if name in b:
                return b
        raise KeyError(name)

    def __getitem__(self, name):
        return self._find(name)[name]

    def __setitem__(self, name, value):
        self._find(name)[name] = value

    def __contains__(self, name):
        return any(name in b for b in self.bufs)


# A sync is built from the frozen stage description (stage.Stage), the backend, its communicators and the
# storage policy (grad_storage.py) the precision side chose; it never sees the engine.
class GradSync(Protocol):
    """What every gradient/parameter synchronisation offers the engine."""
    owned: Range | None          # the flat-buffer range this rank updates (None when it owns several parts)
    owned_parts: list            # what it updates: (flat Range, offset in the owned arrays), params.buffers.packed
    params: FlatBuffer | None    # every parameter of the stage (None under stage 3)
    param_dtype: object          # the compute copy's dtype, as the storage holds it (from store_params on)
    transient_peak: int          # most bytes of temporary buffers held at once
    whole: object                # an optimizer's whole-tensor work division (whole_tensors.py), or None

    # parameters and gradients a block reads and writes during a pass
    def params_for(self, block: str, nxt: str | None = None): ...
    def grads_for(self, block: str): ...         # float32 views; encoded storage: opens the block's scratch
    def grads_done(self, block: str) -> None: ...  # what grads_for handed out is summed: stored through the storage
    def release(self, block: str) -> None: ...
    def param_roots(self) -> set: ...             # ids of the arrays parameter views live in

    # one step: passes, then reduced gradients, then the update, then sharing
    def begin_step(self) -> None: ...
    def begin_pass(self, last: bool) -> None: ...
    def block_done(self, block: str) -> None: ...
    def flush_deferred(self) -> None: ...
    def reduce_grads(self): ...                   # the owned gradient, reduced
    def loss_allreduce(self, losses: list) -> list: ...
    def owned_params(self): ...
    def share_params(self) -> None: ...
    def store_params(self) -> None: ...           # the compute copy as the storage holds it, from now on

    # state and accounting
    def full_params(self) -> np.ndarray: ...      # host values in float (whatever the storage holds)
    def param_bytes(self) -> int: ...
    def grad_bytes(self) -> int: ...
    def comm_names(self) -> dict: ...             # {"grads": [...], "params": [...]} communicators used
    def describe(self) -> str: ...                # one log line ("" when there is nothing to say)


class LocalSync:
    """No replicas: every parameter and gradient lives here; nothing to communicate."""

    def __init__(self, stage, backend, storage=PLAIN, full_grads: bool = True, full_params: bool = True):
        self.stage_desc, self.be, self.storage = stage, backend, storage
        self.layout, self.xp, self.dtype = stage.layout, backend.xp, backend.dtype
        self.param_dtype = np.dtype(self.dtype)     # the float values init writes, until store_params
        self.owned = Range(0, self.layout.total)
        self.owned_parts = [(self.owned, 0)]    # (flat Range, offset in the owned arrays): params.buffers.packed
        self.params = self.grads = None
        if full_params:
            self.params = FlatBuffer(self.layout, self.xp, self.dtype)
            init_flat(self.params, stage.seed)
        if full_grads:
            self.grads = FlatBuffer(self.layout, self.xp, storage.grad_dtype(self.dtype))
        self.last = True
        self.deferred, self.pending = set(stage.tied), []
        self.transient = self.transient_peak = 0
        lay = self.layout
        self.block_ranges, self.deps = stage.block_ranges, stage.deps
        self.block_layouts = {b: Layout(v, lay.tp_rank, lay.tp_size, lay.ep_rank, lay.ep_size)
                              for b, v in stage.block_specs.items() if v}
        # encoded gradients: each open block's gradients a float32 scratch with the count of grads_for calls
        # not yet done
        self.scratch, self.opens = {}, {}
        self.update_grad = 0       # bytes of the float32 owned gradient reduce_grads decoded for the update
        self.whole = None          # make_grad_sync sets it for an optimizer that sees whole tensors

    def _track(self, nbytes: int) -> None:
        self.transient += nbytes
        self.transient_peak = max(self.transient_peak, self.transient)

    # parameter and gradient views the blocks use
    def params_for(self, block, nxt=None):
        return self.params

    def grads_for(self, block):
        """What a block's layers accumulate its gradients into (float32 views, with the blocks it reads).
        Encoded storage: each block's scratch, decoded by the first call and shared by every call until as
        many grads_done have matched them (a split backward's W accumulates into what its B was handed)."""
        if not self.storage.encoded:
            return self._grads_view(block)
        bufs = [self._open(b) for b in (block, *self.deps.get(block, ()))]
        return bufs[0] if len(bufs) == 1 else Merged(bufs)

    def _grads_view(self, block):
        return self.grads

    def _stored(self, b):
        """Block b's stored gradients (float values, or encoded): its range of the full buffer."""
        return self.grads.data[self.block_ranges[b].slice]

    def _open(self, b):
        if b not in self.scratch:
            self.scratch[b] = FlatBuffer(self.block_layouts[b], self.xp, np.float32,
                                         self.storage.decode(self.xp, self._stored(b)))
            self._track(self.scratch[b].data.nbytes)
        self.opens[b] = self.opens.get(b, 0) + 1
        return self.scratch[b]

    def grads_done(self, block) -> None:
        """What grads_for(block) handed out (its own gradients and the blocks it reads) is complete for now:
        stored as the storage keeps a sum (rounded in place); encoded, written into the stored form, each scratch
        freed once no open call holds it (one still held is rounded in place, as it was stored)."""
        st = self.storage
        if not st.rounds:
            return
        for b in (block, *self.deps.get(block, ())):
            if not st.encoded:
                st.round_(self.xp, self._stored(b))
                continue
            s = self.scratch[b]
            st.encode(self.xp, s.data, self._stored(b))
            self.opens[b] -= 1
            if self.opens[b]:
                st.round_(self.xp, s.data)
            else:
                del self.scratch[b], self.opens[b]
                self.transient -= s.data.nbytes

    def _closed(self, blocks) -> None:
        """Encoded: a reduction reads the stored form, so none of its blocks may still have a scratch open."""
        open_ = [b for b in blocks if b in self.scratch]
        if open_:
            raise RuntimeError(f"gradients of block(s) {open_} reduced while a backward still holds them")

    def _update_grad(self, stored):
        """The float32 values of the owned gradient's encoded storage, for the reductions left and the update
        (the activations are gone by then); counted as transient until the next step begins."""
        g = self.storage.decode(self.xp, stored)
        self.update_grad = int(g.nbytes)
        self._track(self.update_grad)
        return g

    def release(self, block):
        pass

    def param_roots(self) -> set:
        return {id(self.params.data)} if self.params is not None else set()

    # step protocol
    def begin_step(self):
        self._end_update_grad()
        self.grads.zero()

    def _end_update_grad(self):
        self.transient -= self.update_grad
        self.update_grad = 0

    def begin_pass(self, last: bool):
        self.last = last

    def block_done(self, block):
        """Backward has finished `block` for this pass; start its sync unless it is deferred (a tied
        embedding whose gradient is first summed across pipeline stages)."""
        if block in self.deferred:
            if self.last:
                self.pending.append(block)
            return
        self._reduce_block(block)

    def flush_deferred(self):
        for b in self.pending:
            self._reduce_block(b)
        self.pending = []

    def _reduce_block(self, block):
        pass

    def reduce_grads(self):
        g = self.grads.data[self.owned.slice]
        return self._update_grad(g) if self.storage.encoded else g

    def owned_params(self):
        return self.params.data[self.owned.slice]

    def share_params(self):
        pass

    def store_params(self) -> None:
        """The compute copy as the storage holds it from now on, converted once from the float values init wrote
        (the engine copies its float32 masters from those first); nothing changes when it holds them as they are
        (a packed copy is read through strategies/bf16_storage.UnpackedParams)."""
        dtype = self.storage.param_dtype(self.dtype)
        if dtype == self.param_dtype:
            return
        self.param_dtype = dtype
        if self.params is not None:
            self.params = FlatBuffer(self.layout, self.xp, dtype, self.storage.params(self.xp, self.params.data))

    def loss_allreduce(self, losses: list) -> list:
        return losses

    # state and accounting
    def full_params(self) -> np.ndarray:
        self.be.sync()
        return self.storage.param_values(np, self.be.to_host(self.params.data)).copy()

    def param_bytes(self) -> int:
        return int(self.params.data.nbytes)

    def grad_bytes(self) -> int:
        return int(self.grads.data.nbytes)

    def comm_names(self) -> dict:
        return {"grads": [], "params": []}

    def describe(self) -> str:
        return self.whole.describe() if self.whole is not None and self.whole.owners() > 1 else ""


class Wires:
    """Gradient reductions in flight on float32 wire buffers (encoded gradients: MPI cannot sum their stored
    form): each entry's requests, its wires and what to do with them once complete (encode the sum back into
    storage), at most MAX_INFLIGHT entries at once; `sync` counts the wires' bytes as transient."""

    def __init__(self, sync):
        self.sync, self.items = sync, []

    def add(self, reqs, wires, done) -> None:
        self.items.append((reqs, wires, done))
        self.sync._track(sum(int(w.nbytes) for w in wires))
        self.progress()
        while len(self.items) > MAX_INFLIGHT:   # completing one is local: every rank issues the same calls
            self._finish(self.items.pop(0), wait=True)

    def progress(self) -> None:
        """Finish the entries whose requests have completed."""
        keep = []
        for it in self.items:
            if testall(it[0]):
                self._finish(it, wait=False)
            else:
                keep.append(it)
        self.items = keep

    def wait(self) -> None:
        for it in self.items:
            self._finish(it, wait=True)
        self.items = []

    def _finish(self, item, wait: bool) -> None:
        reqs, wires, done = item
        if wait:
            waitall(reqs)
        done()
        self.sync.transient -= sum(int(w.nbytes) for w in wires)
