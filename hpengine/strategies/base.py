"""The GradSync interface between the engine and the strategies that hold parameters and gradients,
and LocalSync, its one-replica form: full parameter and gradient buffers, the whole range owned. Under
amp.grad_dtype = "bfloat16" a sync rounds the gradients it stores after every sum; packed, it stores their
bits and hands the layers a float32 scratch per open block (grads_for ... grads_done).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from hpengine.device.bf16_bits import as_float32, from_bf16_bits, to_bf16_bits
from hpengine.device.precision import round_bf16_
from hpengine.dist.comm import testall, waitall
from hpengine.layout.resolve import MAX_INFLIGHT
from hpengine.params.buffers import FlatBuffer, Layout, Range
from hpengine.params.init import init_flat


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


# A sync is built from the frozen stage description (stage.Stage), the backend and its communicators;
# it never sees the engine.
class GradSync(Protocol):
    """What every gradient/parameter synchronisation offers the engine."""
    owned: Range                 # the flat-buffer range this rank updates
    params: FlatBuffer | None    # every parameter of the stage (None under stage 3)
    param_dtype: object          # the compute copy's dtype: the backend's, or uint16 bfloat16 bits
    transient_peak: int          # most bytes of temporary buffers held at once

    # parameters and gradients a block reads and writes during a pass
    def params_for(self, block: str, nxt: str | None = None): ...
    def grads_for(self, block: str): ...         # float32 views; packed: opens the block's scratch
    def grads_done(self, block: str) -> None: ...  # what grads_for handed out is summed: round, or pack
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
    def hold_bf16_bits(self) -> None: ...         # the compute copy as bfloat16 bits from now on
    def hold_bf16_grads(self, packed: bool) -> None: ...  # gradients bfloat16 at rest (packed: as bits)

    # state and accounting
    def full_params(self) -> np.ndarray: ...      # host values in float (bits unpacked)
    def param_bytes(self) -> int: ...
    def grad_bytes(self) -> int: ...
    def comm_names(self) -> dict: ...             # {"grads": [...], "params": [...]} communicators used
    def describe(self) -> str: ...                # one log line ("" when there is nothing to say)


class LocalSync:
    """No replicas: every parameter and gradient lives here; nothing to communicate."""

    def __init__(self, stage, backend, full_grads: bool = True, full_params: bool = True):
        self.stage_desc, self.be = stage, backend
        self.layout, self.xp, self.dtype = stage.layout, backend.xp, backend.dtype
        self.param_dtype = np.dtype(self.dtype)
        self.owned = Range(0, self.layout.total)
        self.params = self.grads = None
        if full_params:
            self.params = FlatBuffer(self.layout, self.xp, self.dtype)
            init_flat(self.params, stage.seed)
        if full_grads:
            self.grads = FlatBuffer(self.layout, self.xp, self.dtype)
        self.last = True
        self.deferred, self.pending = set(stage.tied), []
        self.transient = self.transient_peak = 0
        lay = self.layout
        self.block_ranges, self.deps = stage.block_ranges, stage.deps
        self.block_layouts = {b: Layout(v, lay.tp_rank, lay.tp_size, lay.ep_rank, lay.ep_size)
                              for b, v in stage.block_specs.items() if v}
        # amp.grad_dtype = "bfloat16" (hold_bf16_grads): rounded after each sum; packed: stored as bits, and
        # each open block's gradients a float32 scratch with the count of grads_for calls not yet done
        self.round_grads = self.packed_grads = False
        self.scratch, self.opens = {}, {}
        self.update_grad = 0       # bytes of the float32 owned gradient reduce_grads made (packed) for the update

    def _track(self, nbytes: int) -> None:
        self.transient += nbytes
        self.transient_peak = max(self.transient_peak, self.transient)

    # parameter and gradient views the blocks use
    def params_for(self, block, nxt=None):
        return self.params

    def grads_for(self, block):
        """What a block's layers accumulate its gradients into (float32 views, with the blocks it reads).
        Packed: each block's scratch, unpacked from the bits by the first call and shared by every call until
        as many grads_done have matched them (a split backward's W accumulates into what its B was handed)."""
        if not self.packed_grads:
            return self._grads_view(block)
        bufs = [self._open(b) for b in (block, *self.deps.get(block, ()))]
        return bufs[0] if len(bufs) == 1 else Merged(bufs)

    def _grads_view(self, block):
        return self.grads

    def _stored(self, b):
        """Block b's stored gradients (float32 values, or packed their bits): its range of the full buffer."""
        return self.grads.data[self.block_ranges[b].slice]

    def _open(self, b):
        if b not in self.scratch:
            self.scratch[b] = FlatBuffer(self.block_layouts[b], self.xp, np.float32, from_bf16_bits(self.xp, self._stored(b)))
            self._track(self.scratch[b].data.nbytes)
        self.opens[b] = self.opens.get(b, 0) + 1
        return self.scratch[b]

    def grads_done(self, block) -> None:
        """What grads_for(block) handed out (its own gradients and the blocks it reads) is complete for now:
        under bfloat16 gradients rounded to bfloat16 values where they are stored; packed, stored as their bits,
        each scratch freed once no open call holds it (one still held is rounded in place, as its bits)."""
        if not self.round_grads:
            return
        for b in (block, *self.deps.get(block, ())):
            if not self.packed_grads:
                round_bf16_(self.xp, self._stored(b))
                continue
            s = self.scratch[b]
            to_bf16_bits(self.xp, s.data, out=self._stored(b))
            self.opens[b] -= 1
            if self.opens[b]:
                round_bf16_(self.xp, s.data)
            else:
                del self.scratch[b], self.opens[b]
                self.transient -= s.data.nbytes

    def _closed(self, blocks) -> None:
        """Packed: a reduction reads the bits, so none of its blocks may still have a scratch open."""
        open_ = [b for b in blocks if b in self.scratch]
        if open_:
            raise RuntimeError(f"gradients of block(s) {open_} reduced while a backward still holds them")

    def _update_grad(self, bits):
        """The float32 values of the owned gradient's bits, for the reductions left and the update (the
        activations are gone by then); counted as transient until the next step begins."""
        g = from_bf16_bits(self.xp, bits)
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
        return self._update_grad(g) if self.packed_grads else g

    def owned_params(self):
        return self.params.data[self.owned.slice]

    def share_params(self):
        pass

    def hold_bf16_bits(self) -> None:
        """The compute copy as the bits of its bfloat16 values (uint16, 2 bytes a parameter), converted once from
        the float32 values init wrote; it is read through strategies/bf16_storage.UnpackedParams."""
        self.param_dtype = np.dtype(np.uint16)
        if self.params is not None:
            self.params = FlatBuffer(self.layout, self.xp, np.uint16, to_bf16_bits(self.xp, self.params.data))

    def hold_bf16_grads(self, packed: bool) -> None:
        """Gradients as bfloat16 values at rest from now on (amp.grad_dtype = "bfloat16"): rounded by grads_done
        and after each sum of the reduction; packed: stored as their bits (uint16, 2 bytes an element), which
        MPI cannot sum: each reduction sums float32 copies (wire buffers) and packs the result back."""
        self.round_grads, self.packed_grads = True, packed
        if packed:
            self._hold_grad_bits()

    def _hold_grad_bits(self) -> None:
        if self.grads is not None:
            self.grads = FlatBuffer(self.layout, self.xp, np.uint16)

    def loss_allreduce(self, losses: list) -> list:
        return losses

    # state and accounting
    def full_params(self) -> np.ndarray:
        self.be.sync()
        return as_float32(np, self.be.to_host(self.params.data)).copy()

    def param_bytes(self) -> int:
        return int(self.params.data.nbytes)

    def grad_bytes(self) -> int:
        return int(self.grads.data.nbytes)

    def comm_names(self) -> dict:
        return {"grads": [], "params": []}

    def describe(self) -> str:
        return ""


class Wires:
    """Gradient reductions in flight on float32 wire buffers (packed gradients: MPI has no bfloat16 sum): each
    entry's requests, its wires and what to do with them once complete (pack the sum back into bits), at most
    MAX_INFLIGHT entries at once; `sync` counts the wires' bytes as transient."""

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
