"""The engine: builds the mesh, this rank's model stage, its flat buffers and the strategies, and runs
one optimizer step (forward/backward over the step's passes, gradient sync, clipping, owned-shard
AdamW, parameter sharing). Strategies plug in through the GradSync interface.
"""
from __future__ import annotations

import logging
import resource
import time

import numpy as np

from .buffers import FlatBuffer, Layout, Range
from .init import init_flat
from .models import LocalTP, build_model
from .optim import AdamW, clip_coefficient, lr_at, sum_of_squares
from .strategies import make_grad_sync

log = logging.getLogger("hpengine")


class Engine:
    def __init__(self, cfg, mesh, backend, dataset):
        self.cfg, self.mesh, self.be, self.data = cfg, mesh, backend, dataset
        self.xp = backend.xp
        self.model = build_model(cfg.model)
        self.tp = LocalTP()
        self.blocks = self.model.block_names()
        specs = [s for b in self.blocks for s in self.model.specs(b)]
        self.layout = Layout(specs, self.tp.rank, self.tp.size)
        self.block_ranges = self._block_ranges()
        self.params = FlatBuffer(self.layout, self.xp, backend.dtype)
        init_flat(self.params, cfg.train.seed)
        self.sync = make_grad_sync(cfg, mesh, self)
        own = self.sync.owned
        self.opt = AdamW(self.xp, self.layout, own, backend.dtype, tuple(cfg.optim.betas),
                         cfg.optim.eps, cfg.optim.weight_decay)
        self.replicas = mesh.degrees["dp"] * mesh.degrees["sharding"]
        self.replica = mesh.coords["dp"] * mesh.degrees["sharding"] + mesh.coords["sharding"]
        self.share = cfg.train.global_batch // self.replicas
        self.k = cfg.strategy.gradient_merge.k_steps if cfg.strategy.gradient_merge.enable else 1
        self.step_count = 0

    def _block_ranges(self) -> dict:
        out = {}
        for b in self.blocks:
            names = [s.name for s in self.model.specs(b)]
            if names:
                out[b] = Range(self.layout.ranges[names[0]].start, self.layout.ranges[names[-1]].stop)
        return out

    # --- forward / backward ---------------------------------------------------------------------
    def forward_backward(self, x, y, norm: float, grad: bool = True) -> float:
        """One pass over rows x, y of the batch; returns this pass's share of the global-mean loss."""
        xp, m, tp = self.xp, self.model, self.tp
        P = self.sync.params_for
        h, c_emb = m.embed_forward(xp, P("embed"), x, tp)
        caches = []
        for i in range(m.n_layers):
            h, c = m.layer_forward(xp, P(f"h.{i}"), i, h, tp)
            caches.append(c if grad else None)
        loss, c_head = m.head_forward(xp, P("head"), h, y, norm, tp)
        if not grad:
            return float(loss)
        G = self.sync.grads_for
        dh = m.head_backward(xp, c_head, G("head"), tp, P("head"))
        self.sync.block_done("head")
        for i in reversed(range(m.n_layers)):
            dh = m.layer_backward(xp, dh, caches[i], G(f"h.{i}"), i, tp)
            caches[i] = None
            self.sync.block_done(f"h.{i}")
        m.embed_backward(xp, dh, c_emb, G("embed"), tp)
        self.sync.block_done("embed")
        return float(loss)

    def _rows(self, split, step):
        x, y = self.data.batch(split, step, self.cfg.train.seed, self.cfg.train.global_batch,
                               start=self.replica * self.share, count=self.share)
        return self.be.to_device(x), self.be.to_device(y)

    # --- one optimizer step ---------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        cfg = self.cfg
        x, y = self._rows("train", step)
        norm = float(cfg.train.global_batch * cfg.model.seq_len)
        self.sync.begin_step()
        loss, rows = 0.0, self.share // self.k
        for j in range(self.k):
            self.sync.begin_pass(last=(j == self.k - 1))
            loss += self.forward_backward(x[j * rows:(j + 1) * rows], y[j * rows:(j + 1) * rows], norm)
        g = self.sync.reduce_grads()                   # this rank's owned range, globally summed
        sq = self.sync.norm_allreduce(sum_of_squares(self.xp, g))
        gnorm = float(np.sqrt(sq))
        coef = clip_coefficient(gnorm, cfg.optim.clip_grad_norm)
        lr = lr_at(step, cfg.optim, cfg.train.steps)
        own = self.sync.owned
        self.opt.step(self.sync.owned_params(), g, lr, coef)
        self.sync.share_params()
        loss = self.sync.loss_allreduce(loss)
        self.be.sync()
        dt = time.perf_counter() - t0
        self.step_count = step + 1
        toks = cfg.train.global_batch * cfg.model.seq_len
        del own
        return {"step": step, "loss": loss, "lr": lr, "grad_norm": gnorm,
                "tokens_per_s": toks / dt, "step_ms": dt * 1e3}

    def evaluate(self) -> float:
        cfg = self.cfg
        norm = float(cfg.train.global_batch * cfg.model.seq_len * cfg.train.eval_batches)
        total = 0.0
        for i in range(cfg.train.eval_batches):
            x, y = self._rows("val", i)
            total += self.forward_backward(x, y, norm, grad=False)
        return self.sync.loss_allreduce(total)

    # --- accounting -----------------------------------------------------------------------------
    def memory(self) -> dict:
        return {"param_bytes": self.sync.param_bytes(), "grad_bytes": self.sync.grad_bytes(),
                "optim_bytes": self.opt.nbytes(),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def n_params(self) -> int:
        return sum(int(np.prod(s.global_shape)) for s in self.layout.specs)
