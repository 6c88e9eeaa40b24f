"""The engine: builds this rank's model stage (one or several models sharing one flat buffer and one
partition), the gradient-sync strategy and the owned-shard AdamW, and runs one optimizer step:
forward/backward over the step's passes, gradient sync, clipping, AdamW, parameter sharing.
"""
from __future__ import annotations

import dataclasses
import logging
import resource
import time

import numpy as np

from .buffers import Layout, Range
from .models import LocalTP, build_model
from .optim import AdamW, clip_coefficient, lr_at, sum_of_squares
from .strategies import make_grad_sync

log = logging.getLogger("hpengine")


class Prefixed:
    """A model's view of a shared buffer: its names without the 'm{i}.' prefix."""

    def __init__(self, buf, prefix):
        self.buf, self.prefix = buf, prefix

    def __getitem__(self, name):
        return self.buf[self.prefix + name]

    def __setitem__(self, name, value):
        self.buf[self.prefix + name] = value


@dataclasses.dataclass
class Slot:
    """One model of the job: its object, name prefix, seed, peak lr and Range of the flat buffer."""
    index: int
    model: object
    prefix: str
    seed: int
    lr: float
    blocks: list
    range: Range = None


class Engine:
    def __init__(self, cfg, mesh, backend, dataset):
        self.cfg, self.mesh, self.be, self.data = cfg, mesh, backend, dataset
        self.xp = backend.xp
        self.tp = LocalTP()
        self.slots, specs = self._build_slots(cfg)
        self.layout = Layout(specs, self.tp.rank, self.tp.size)
        self.blocks = [b for s in self.slots for b in s.blocks]
        self.block_specs = {b: [sp for sp in specs if sp.block == b] for b in self.blocks}
        self.block_ranges = {b: Range(self.layout.ranges[v[0].name].start, self.layout.ranges[v[-1].name].stop)
                             for b, v in self.block_specs.items() if v}
        for s in self.slots:
            s.range = Range(self.block_ranges[s.blocks[0]].start, self.block_ranges[s.blocks[-1]].stop)
        # blocks that also read another block's tensors (a tied head reads the token embedding)
        self.block_deps = {s.prefix + "head": [s.prefix + "embed"] for s in self.slots if cfg.model.tie_head}
        self.sync = make_grad_sync(cfg, mesh, self)
        self.opts = self._build_optimizers()
        self.replicas = mesh.degrees["dp"] * mesh.degrees["sharding"]
        self.replica = mesh.coords["dp"] * mesh.degrees["sharding"] + mesh.coords["sharding"]
        self.share = cfg.train.global_batch // self.replicas
        self.k = cfg.strategy.gradient_merge.k_steps if cfg.strategy.gradient_merge.enable else 1

    def _build_slots(self, cfg):
        t = cfg.train
        seeds = t.model_seeds or [t.seed + i for i in range(t.models)]
        lrs = t.model_lrs or [cfg.optim.lr] * t.models
        slots, specs = [], []
        for i in range(t.models):
            model, prefix = build_model(cfg.model), (f"m{i}." if t.models > 1 else "")
            slots.append(Slot(i, model, prefix, seeds[i], lrs[i], [prefix + b for b in model.block_names()]))
            specs += [dataclasses.replace(sp, name=prefix + sp.name, block=prefix + b, init_key=sp.name,
                                          seed=seeds[i])
                      for b in model.block_names() for sp in model.specs(b)]
        return slots, specs

    def _build_optimizers(self):
        o, own = self.cfg.optim, self.sync.owned
        out = []
        for s in self.slots:
            seg = own.intersect(s.range)
            out.append(None if seg is None else
                       AdamW(self.xp, self.layout, seg, self.be.dtype, tuple(o.betas), o.eps, o.weight_decay))
        return out

    # --- forward / backward ---------------------------------------------------------------------
    def _P(self, slot, b, nxt=None):
        buf = self.sync.params_for(slot.prefix + b, nxt and slot.prefix + nxt)
        return Prefixed(buf, slot.prefix) if slot.prefix else buf

    def _G(self, slot, b):
        buf = self.sync.grads_for(slot.prefix + b)
        return Prefixed(buf, slot.prefix) if slot.prefix else buf

    def forward_backward(self, slot, x, y, norm: float, grad: bool = True) -> float:
        """One pass of one model over rows x, y; returns its share of the global-mean loss."""
        xp, m, tp, sync = self.xp, slot.model, self.tp, self.sync
        names = m.block_names()
        h, c_emb = m.embed_forward(xp, self._P(slot, "embed", names[1]), x, tp)
        sync.release(slot.prefix + "embed")
        caches = []
        for i in range(m.n_layers):
            h, c = m.layer_forward(xp, self._P(slot, f"h.{i}", names[i + 2]), i, h, tp)
            sync.release(slot.prefix + f"h.{i}")
            caches.append(c if grad else None)
        loss, c_head = m.head_forward(xp, self._P(slot, "head"), h, y, norm, tp)
        if not grad:
            sync.release(slot.prefix + "head")
            return float(loss)
        dh = m.head_backward(xp, c_head, self._G(slot, "head"), tp, self._P(slot, "head", names[-2]))
        self._done(slot, "head")
        for i in reversed(range(m.n_layers)):
            dh = m.layer_backward(xp, dh, caches[i], self._G(slot, f"h.{i}"), i, tp)
            caches[i] = None
            self._done(slot, f"h.{i}")
        m.embed_backward(xp, dh, c_emb, self._G(slot, "embed"), tp)
        self._done(slot, "embed")
        return float(loss)

    def _done(self, slot, b):
        self.sync.release(slot.prefix + b)
        self.sync.block_done(slot.prefix + b)

    def _rows(self, split, step, seed):
        x, y = self.data.batch(split, step, seed, self.cfg.train.global_batch,
                               start=self.replica * self.share, count=self.share)
        return self.be.to_device(x), self.be.to_device(y)

    # --- one optimizer step ---------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        """One optimizer step of every model. Returns the metrics of the step (same on every rank);
        with several models, 'models' holds one entry per model."""
        t0 = time.perf_counter()
        cfg = self.cfg
        norm = float(cfg.train.global_batch * cfg.model.seq_len)
        batches = [self._rows("train", step, s.seed) for s in self.slots]
        self.sync.begin_step()
        losses, rows = [0.0] * len(self.slots), self.share // self.k
        for j in range(self.k):
            self.sync.begin_pass(last=(j == self.k - 1))
            for s, (x, y) in zip(self.slots, batches):
                part = slice(j * rows, (j + 1) * rows)
                losses[s.index] += self.forward_backward(s, x[part], y[part], norm)
        g, own = self.sync.reduce_grads(), self.sync.owned
        segs = [own.intersect(s.range) for s in self.slots]
        sq = [sum_of_squares(self.xp, g[r.start - own.start:r.stop - own.start]) if r else 0.0 for r in segs]
        norms = [float(np.sqrt(v)) for v in self.sync.norm_allreduce(sq)]
        p = self.sync.owned_params()
        lr_scale = lr_at(step, cfg.optim, cfg.train.steps) / cfg.optim.lr if cfg.optim.lr else 0.0
        for s, r, opt in zip(self.slots, segs, self.opts):
            if opt is not None:
                coef = clip_coefficient(norms[s.index], cfg.optim.clip_grad_norm)
                sl = slice(r.start - own.start, r.stop - own.start)
                opt.step(p[sl], g[sl], s.lr * lr_scale, coef)
        self.sync.share_params()
        losses = self.sync.loss_allreduce(losses)
        self.be.sync()
        dt = time.perf_counter() - t0
        per = [{"model": s.index, "loss": losses[s.index], "lr": s.lr * lr_scale, "grad_norm": norms[s.index]}
               for s in self.slots]
        toks = cfg.train.global_batch * cfg.model.seq_len * len(self.slots)
        out = {"step": step, **{k: v for k, v in per[0].items() if k != "model"},
               "tokens_per_s": toks / dt, "step_ms": dt * 1e3}
        if len(self.slots) > 1:
            out["models"] = per
        return out

    def evaluate(self) -> list[float]:
        """Validation loss of every model on the first eval_batches validation batches."""
        cfg = self.cfg
        norm = float(cfg.train.global_batch * cfg.model.seq_len * cfg.train.eval_batches)
        totals = [0.0] * len(self.slots)
        for s in self.slots:
            for i in range(cfg.train.eval_batches):
                x, y = self._rows("val", i, s.seed)
                totals[s.index] += self.forward_backward(s, x, y, norm, grad=False)
        return self.sync.loss_allreduce(totals)

    # --- state and accounting -------------------------------------------------------------------
    def full_params(self) -> np.ndarray:
        """The whole flat parameter vector on the host (gathered under stage 3)."""
        return self.sync.full_params()

    def memory(self) -> dict:
        return {"param_bytes": self.sync.param_bytes(), "grad_bytes": self.sync.grad_bytes(),
                "optim_bytes": sum(o.nbytes() for o in self.opts if o is not None),
                "transient_peak_bytes": self.sync.transient_peak,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def n_params(self) -> int:
        return sum(int(np.prod(s.global_shape)) for s in self.layout.specs)
