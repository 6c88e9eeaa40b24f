"""The GradSync interface between the engine and the strategies that hold parameters and gradients,
and LocalSync, its one-replica form: full parameter and gradient buffers, the whole range owned.

A sync is built from the frozen stage description (stage.Stage), the backend and its communicators;
it never sees the engine.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from hpengine.device.bf16_bits import as_float32, to_bf16_bits
from hpengine.params.buffers import FlatBuffer, Range
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


class GradSync(Protocol):
    """What every gradient/parameter synchronisation offers the engine."""
    owned: Range                 # the flat-buffer range this rank updates
    params: FlatBuffer | None    # every parameter of the stage (None under stage 3)
    param_dtype: object          # the compute copy's dtype: the backend's, or uint16 bfloat16 bits
    transient_peak: int          # most bytes of temporary buffers held at once

    # parameters and gradients a block reads and writes during a pass
    def params_for(self, block: str, nxt: str | None = None): ...
    def grads_for(self, block: str): ...
    def release(self, block: str) -> None: ...
    def param_roots(self) -> set: ...             # ids of the arrays parameter views live in

    # one step: passes, then reduced gradients, then the update, then sharing
    def begin_step(self) -> None: ...
    def begin_pass(self, last: bool) -> None: ...
    def block_done(self, block: str) -> None: ...
    def flush_deferred(self) -> None: ...
    def reduce_grads(self): ...                   # the owned gradient, reduced
    def norm_allreduce(self, sq: list) -> list: ...
    def loss_allreduce(self, losses: list) -> list: ...
    def owned_params(self): ...
    def share_params(self) -> None: ...
    def hold_bf16_bits(self) -> None: ...         # the compute copy as bfloat16 bits from now on

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

    def param_roots(self) -> set:
        return {id(self.params.data)} if self.params is not None else set()

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

    def hold_bf16_bits(self) -> None:
        """The compute copy as the bits of its bfloat16 values (uint16, 2 bytes a parameter), converted once from
        the float32 values init wrote; it is read through strategies/bf16_storage.UnpackedParams."""
        self.param_dtype = np.dtype(np.uint16)
        if self.params is not None:
            self.params = FlatBuffer(self.layout, self.xp, np.uint16, to_bf16_bits(self.xp, self.params.data))

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
