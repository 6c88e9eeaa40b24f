"""The GradSync interface between the engine and the strategies that own parameters and gradients,
and LocalSync, its one-replica form: full parameter and gradient buffers, the whole range owned.
"""
from __future__ import annotations

from ..buffers import FlatBuffer, Range


class LocalSync:
    """No replicas: every parameter and gradient lives here; nothing to communicate."""

    def __init__(self, engine):
        self.e = engine
        self.layout = engine.layout
        self.grads = FlatBuffer(self.layout, engine.xp, engine.be.dtype)
        self.owned = Range(0, self.layout.total)

    # parameter and gradient views the blocks use
    def params_for(self, block):
        return self.e.params

    def grads_for(self, block):
        return self.grads

    # step protocol
    def begin_step(self):
        self.grads.zero()

    def begin_pass(self, last: bool):
        pass

    def block_done(self, block):
        pass

    def reduce_grads(self):
        return self.grads.data[self.owned.slice]

    def norm_allreduce(self, sq: float) -> float:
        return sq

    def owned_params(self):
        return self.e.params.data[self.owned.slice]

    def share_params(self):
        pass

    def loss_allreduce(self, loss: float) -> float:
        return loss

    # accounting
    def param_bytes(self) -> int:
        return int(self.e.params.data.nbytes)

    def grad_bytes(self) -> int:
        return int(self.grads.data.nbytes)
