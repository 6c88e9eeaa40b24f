"""The GradSync interface between the engine and the strategies that hold parameters and gradients,
and LocalSync, its one-replica form: full parameter and gradient buffers, the whole range owned.
"""
from __future__ import annotations

import numpy as np

from ..buffers import FlatBuffer, Range
from ..init import init_flat


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


class LocalSync:
    """No replicas: every parameter and gradient lives here; nothing to communicate."""

    def __init__(self, engine, full_grads: bool = True, full_params: bool = True):
        self.e = engine
        self.layout, self.xp, self.dtype = engine.layout, engine.xp, engine.be.dtype
        self.owned = Range(0, self.layout.total)
        self.params = self.grads = None
        if full_params:
            self.params = FlatBuffer(self.layout, self.xp, self.dtype)
            init_flat(self.params, engine.cfg.train.seed)
        if full_grads:
            self.grads = FlatBuffer(self.layout, self.xp, self.dtype)
        self.last = True
        self.deferred, self.pending = set(engine.tied), []
        self.transient = self.transient_peak = 0

    def _track(self, nbytes: int) -> None:
        self.transient += nbytes
        self.transient_peak = max(self.transient_peak, self.transient)

    # parameter and gradient views the blocks use
    def params_for(self, block, nxt=None):
        return self.params

    def grads_for(self, block):
        return self.grads

    def release(self, block):
        pass

    # step protocol
    def begin_step(self):
        self.grads.zero()

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
        return self.grads.data[self.owned.slice]

    def norm_allreduce(self, sq: list) -> list:
        return sq

    def owned_params(self):
        return self.params.data[self.owned.slice]

    def share_params(self):
        pass

    def loss_allreduce(self, losses: list) -> list:
        return losses

    # state and accounting
    def full_params(self) -> np.ndarray:
        self.e.be.sync()
        return self.e.be.to_host(self.params.data).copy()

    def param_bytes(self) -> int:
        return int(self.params.data.nbytes)

    def grad_bytes(self) -> int:
        return int(self.grads.data.nbytes)
