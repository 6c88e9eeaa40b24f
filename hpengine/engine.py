"""The engine: builds this rank's model stage (one or several models sharing one flat buffer and one
partition), the gradient-sync strategy and the owned-shard AdamW, and runs one optimizer step:
forward/backward over the step's passes, gradient sync, clipping, AdamW, parameter sharing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import resource
import time

import numpy as np

from mpi4py import MPI

from .buffers import Layout, Range
from .comm import Comm
from .engine_state import EngineState
from .init import init_range
from .models import LocalTP, build_model
from .optim import AdamW, clip_coefficient, lr_at, sum_of_squares
from .strategies import make_grad_sync
from .strategies.amp import LossScaler
from .strategies.pipeline import PipelineExecutor, split_blocks
from .strategies.tensor_parallel import TensorParallel
from .trace import Tracer

log = logging.getLogger("hpengine")


class NonFiniteError(RuntimeError):
    """A NaN or inf reached the loss or gradients (outside amp's loss scaling)."""


class Prefixed:
    """A model's view of a shared buffer: its names without the 'm{i}.' prefix."""

    def __init__(self, buf, prefix):
        self.buf, self.prefix = buf, prefix

    def __getitem__(self, name):
        return self.buf[self.prefix + name]

    def __setitem__(self, name, value):
        self.buf[self.prefix + name] = value


@dataclasses.dataclass
class Recompute:
    """The cache of a recomputed block: just its input."""
    x: object


def cache_nbytes(obj, skip_roots: set, seen=None) -> int:
    """Bytes of the distinct arrays inside a nested cache, skipping views of parameter storage."""
    seen = set() if seen is None else seen
    if isinstance(obj, (tuple, list)):
        return sum(cache_nbytes(o, skip_roots, seen) for o in obj)
    if isinstance(obj, Recompute):
        return cache_nbytes(obj.x, skip_roots, seen)
    if not hasattr(obj, "nbytes") or not hasattr(obj, "base"):
        return 0
    root = obj
    while getattr(root, "base", None) is not None:
        root = root.base
    if id(root) in skip_roots or id(root) in seen:
        return 0
    seen.add(id(root))
    return int(root.nbytes)


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
    chunks: list = None


class Engine(EngineState):
    def __init__(self, cfg, mesh, backend, dataset):
        self.cfg, self.mesh, self.be, self.data = cfg, mesh, backend, dataset
        self.xp = backend.xp
        tpc = mesh.comms["tp"]
        self.tp = TensorParallel(tpc, cfg.model.vocab_size) if tpc.size > 1 else LocalTP()
        self.slots, specs = self._build_slots(cfg)
        self.layout = Layout(specs, self.tp.rank, self.tp.size)
        self.blocks = [b for s in self.slots for b in s.blocks]
        self.block_specs = {b: [sp for sp in specs if sp.block == b] for b in self.blocks}
        self.block_ranges = {b: Range(self.layout.ranges[v[0].name].start, self.layout.ranges[v[-1].name].stop)
                             for b, v in self.block_specs.items() if v}
        for s in self.slots:
            s.range = Range(self.block_ranges[s.blocks[0]].start, self.block_ranges[s.blocks[-1]].stop)
        # blocks that also read another block's tensors (a tied head reads the token embedding)
        self.block_deps = {s.prefix + "head": [s.prefix + "embed"] for s in self.slots
                           if cfg.model.tie_head and s.prefix + "embed" in s.blocks and s.prefix + "head" in s.blocks}
        self.tied = self._tied_blocks(cfg)
        self.sync = make_grad_sync(cfg, mesh, self)
        self.world = Comm(mesh.world, "world", backend)
        self.scaler = LossScaler(cfg.strategy.amp) if cfg.strategy.amp.enable else None
        # amp: float32 master weights of the owned range, from the exact (unrounded) initial values
        self.master = (init_range(self.layout, cfg.train.seed, self.sync.owned, self.xp, np.float32)
                       if self.scaler else None)
        # every parameter counts once in the global norm: not the last stage's wte copy, and a tensor
        # replicated across tp only on tp rank 0
        self.tied_copies = {w for b, w in self.tied.items() if b.endswith("head")}
        self.norm_exclude = [self.layout.ranges[n] for n in sorted(self.tied_copies)]
        if self.tp.rank > 0:
            self.norm_exclude += [self.layout.ranges[sp.name] for sp in specs if sp.tp_dim is None]
        self.opts = self._build_optimizers()
        self.replicas = mesh.degrees["dp"] * mesh.degrees["sharding"]
        self.replica = mesh.coords["dp"] * mesh.degrees["sharding"] + mesh.coords["sharding"]
        self.share = cfg.train.global_batch // self.replicas
        self.k = cfg.strategy.gradient_merge.k_steps if cfg.strategy.gradient_merge.enable else 1
        self.cache_bytes = self.cache_peak = 0
        self.opt_steps = 0          # optimizer updates applied (AdamW's bias-correction count)
        self.unit_lr = dataclasses.replace(cfg.optim, lr=1.0)
        pc = cfg.strategy.pipeline
        self.m = pc.micro_batches if pc.enable else 1
        self.pp = mesh.comms["pp"]
        self.pipe = PipelineExecutor(self, self.pp, None, mesh.degrees["pp"], pc.virtual_stages if pc.enable else 1,
                                     self.m, pc.schedule if pc.enable else "fthenb")
        self.tracer = Tracer()   # issue 11: phase timers; train.py hands in a recording one under runtime.trace

    def _tied_blocks(self, cfg) -> dict:
        """{block: its wte tensor} — with a tied head split across pipeline stages, the first stage's embed
        block and the last stage's head block (holding a copy of wte) sum their wte gradients before the
        usual sync."""
        if not cfg.model.tie_head or self.mesh.degrees["pp"] == 1:
            return {}
        pp, last = self.mesh.coords["pp"], self.mesh.degrees["pp"] - 1
        return {s.prefix + b: s.prefix + "wte" for s in self.slots
                for b in (["embed"] if pp == 0 else []) + (["head"] if pp == last else [])}

    def _build_slots(self, cfg):
        t, pc = cfg.train, cfg.strategy.pipeline
        seeds = t.model_seeds or [t.seed + i for i in range(t.models)]
        lrs = t.model_lrs or [cfg.optim.lr] * t.models
        p, v = self.mesh.degrees["pp"], (pc.virtual_stages if pc.enable else 1)
        slots, specs = [], []
        for i in range(t.models):
            model, prefix = build_model(cfg.model, self.tp.size), (f"m{i}." if t.models > 1 else "")
            count = lambda b, m=model: sum(int(np.prod(sp.global_shape)) for sp in m.specs(b))  # noqa: E731
            chunks = split_blocks(model, p, v, pc.split if pc.enable else "uniform", count)
            here = [chunks[c * p + self.mesh.coords["pp"]] for c in range(v)]
            mine = [b for ch in here for b in ch]
            slot = Slot(i, model, prefix, seeds[i], lrs[i], [prefix + b for b in mine])
            slot.chunks = here
            slots.append(slot)
            for b in mine:
                bspecs = model.specs(b)
                if b == "head" and model.tied and "embed" not in mine:   # the last stage's copy of wte
                    bspecs = [dataclasses.replace(model.specs("embed")[0], block="head")] + bspecs
                specs += [dataclasses.replace(sp, name=prefix + sp.name, block=prefix + b, init_key=sp.name,
                                              seed=seeds[i]) for sp in bspecs]
        return slots, specs

    def _build_optimizers(self):
        o, own = self.cfg.optim, self.sync.owned
        out = []
        for s in self.slots:
            seg = own.intersect(s.range)
            dtype = np.float32 if self.scaler else self.be.dtype
            out.append(None if seg is None else
                       AdamW(self.xp, self.layout, seg, dtype, tuple(o.betas), o.eps, o.weight_decay))
        return out

    # --- forward / backward ---------------------------------------------------------------------
    def _P(self, slot, b, nxt=None):
        buf = self.sync.params_for(slot.prefix + b, nxt and slot.prefix + nxt)
        return Prefixed(buf, slot.prefix) if slot.prefix else buf

    def _G(self, slot, b):
        buf = self.sync.grads_for(slot.prefix + b)
        return Prefixed(buf, slot.prefix) if slot.prefix else buf

    def chunk_forward(self, slot, chunk, h, y, norm: float, grad: bool = True):
        """Forward of one chunk (consecutive block names) of one model; the head returns the loss.
        A recomputed block keeps only its input; backward rebuilds its activations."""
        xp, m, tp, sync, caches = self.xp, slot.model, self.tp, self.sync, []
        for n, b in enumerate(chunk):
            nxt = chunk[n + 1] if n + 1 < len(chunk) else None
            h_in = h
            if b == "embed":
                h, c = m.embed_forward(xp, self._P(slot, b, nxt), h, tp)
            elif b == "head":
                h, c = m.head_forward(xp, self._P(slot, b), h, y, norm, tp)
            else:
                h, c = m.layer_forward(xp, self._P(slot, b, nxt), int(b[2:]), h, tp)
                if self._recomputed(b):
                    c = Recompute(h_in)
            sync.release(slot.prefix + b)
            caches.append(c if grad else None)
        if grad:
            self._count_caches(caches, +1)
        return h, caches

    def chunk_backward(self, slot, chunk, d, caches):
        """Backward of one chunk; returns the gradient of its input (None for the embedding)."""
        xp, m, tp = self.xp, slot.model, self.tp
        self._count_caches(caches, -1)
        for n in reversed(range(len(chunk))):
            b, c = chunk[n], caches[n]
            caches[n] = None
            if b == "head":
                prev = chunk[n - 1] if n and chunk[n - 1] != "embed" else None
                d = m.head_backward(xp, c, self._G(slot, b), tp, self._P(slot, b, prev),
                                    self.scaler.scale if self.scaler else 1.0)
            elif b == "embed":
                m.embed_backward(xp, d, c, self._G(slot, b), tp)
                d = None
            else:
                i = int(b[2:])
                # stage 3 gathers the block's parameters again here, prefetching the block before it
                prev = chunk[n - 1] if n and chunk[n - 1] != "embed" else None   # embed backward reads no params
                P = self._P(slot, b, prev)
                if isinstance(c, Recompute):     # rebuild this block's activations from its input
                    _, c = m.layer_forward(xp, P, i, c.x, tp)
                d = m.layer_backward(xp, d, c, P, self._G(slot, b), i, tp)
            self._done(slot, b)
        return d

    def _recomputed(self, block: str) -> bool:
        rc = self.cfg.strategy.recompute
        return rc.enable and int(block[2:]) % rc.every == 0

    def _count_caches(self, caches, sign: int) -> None:
        """Bytes of live activation caches (parameters they reference are not counted)."""
        self.cache_bytes += sign * cache_nbytes(caches, self._param_roots())
        self.cache_peak = max(self.cache_peak, self.cache_bytes)

    def _param_roots(self) -> set:
        roots = {id(self.sync.params.data)} if self.sync.params is not None else set()
        return roots | {id(buf.data) for buf, _ in getattr(self.sync, "gathered", {}).values()}

    def forward_backward(self, slot, x, y, norm: float, grad: bool = True, last_pass: bool = True) -> float:
        """One pass of one model over rows x, y (split into micro-batches, through the pipeline when it
        is on); returns this rank's share of the global-mean loss."""
        self.pipe.chunks = slot.chunks
        return self.pipe.run(slot, x, y, norm, last_pass, grad)

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
        cfg, tr = self.cfg, self.tracer      # issue 11: phase timers (F/B and pipeline idle: the executor)
        t = tr.now()
        norm = float(cfg.train.global_batch * cfg.model.seq_len)
        batches = [self._rows("train", step, s.seed) for s in self.slots]
        tr.lap("data", t)
        self.sync.begin_step()
        losses, rows = [0.0] * len(self.slots), self.share // self.k
        # under amp an overflow is expected and handled (the step is skipped): no NumPy warnings for it
        with np.errstate(over="ignore", invalid="ignore") if self.scaler else contextlib.nullcontext():
            for j in range(self.k):
                for s, (x, y) in zip(self.slots, batches):
                    part = slice(j * rows, (j + 1) * rows)
                    losses[s.index] += self.forward_backward(s, x[part], y[part], norm,
                                                             last_pass=(j == self.k - 1))
        t = tr.now()
        self._sum_tied()
        g, own = self.sync.reduce_grads(), self.sync.owned
        t = tr.lap("grad sync wait", t)
        if self.scaler is not None:
            g = self._unscale(g)
            if g is None:          # overflow somewhere: every rank skips this step together
                return self._skipped_step(step, t0, losses)
        segs = [own.intersect(s.range) for s in self.slots]
        sq = [self._sumsq(g, r) for r in segs]
        sq = self.pp.allreduce_(np.array(self.sync.norm_allreduce(sq)))
        norms = [float(np.sqrt(v)) for v in self.mesh.comms["tp"].allreduce_(sq)]
        if not np.isfinite(norms).all():      # the same reduced values on every rank: a collective decision
            self._report_non_finite(step, losses, g)
        p = self.sync.owned_params() if self.master is None else self.master
        lr_scale = lr_at(step, self.unit_lr, cfg.train.steps)     # the schedule's factor; each model has its lr
        for s, r, opt in zip(self.slots, segs, self.opts):
            if opt is not None:
                coef = clip_coefficient(norms[s.index], cfg.optim.clip_grad_norm)
                sl = slice(r.start - own.start, r.stop - own.start)
                opt.step(p[sl], g[sl], s.lr * lr_scale, coef)
        if self.master is not None:
            self.sync.owned_params()[...] = self.master      # the float16 compute copy
        if self.scaler is not None:
            self.scaler.update(True)
        self.opt_steps += 1
        t = tr.lap("optimizer", t)
        self.sync.share_params()
        t = tr.lap("param share", t)
        losses = list(self.pp.allreduce_(np.array(self.sync.loss_allreduce(losses))))
        self.be.sync()
        tr.lap("loss sync", t)
        dt = time.perf_counter() - t0
        per = [{"model": s.index, "loss": losses[s.index], "lr": s.lr * lr_scale, "grad_norm": norms[s.index]}
               for s in self.slots]
        toks = cfg.train.global_batch * cfg.model.seq_len * len(self.slots)
        out = {"step": step, **{k: v for k, v in per[0].items() if k != "model"},
               "tokens_per_s": toks / dt, "step_ms": dt * 1e3}
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.scale
        if len(self.slots) > 1:
            out["models"] = per
        return out

    def _report_non_finite(self, step, losses, g):
        """A NaN/inf loss or gradient is reported with the step and the ranks that saw it, never trained on."""
        bad = not (np.isfinite(losses).all() and bool(self.xp.isfinite(g).all()))
        ranks = [r for r, b in enumerate(self.world.allgather_obj(bad)) if b]
        raise NonFiniteError(f"step {step + 1}: non-finite loss or gradient on rank(s) {ranks} "
                             f"(losses here: {losses}); stopping instead of training on it")

    def _unscale(self, g):
        """float32 unscaled copy of the owned gradient, or None when any rank saw inf/nan."""
        finite = bool(self.xp.isfinite(g).all())
        if not self.world.allreduce_obj(finite, op=MPI.LAND):
            return None
        g32 = g.astype(np.float32)
        g32 *= 1.0 / self.scaler.scale
        return g32

    def _skipped_step(self, step, t0, losses):
        self.scaler.update(False)
        log.warning("step %d: gradient overflow, step skipped on every rank; loss scale -> %g",
                    step + 1, self.scaler.scale)
        self.sync.share_params()
        losses = list(self.pp.allreduce_(np.array(self.sync.loss_allreduce(losses))))
        dt = time.perf_counter() - t0
        toks = self.cfg.train.global_batch * self.cfg.model.seq_len * len(self.slots)
        out = {"step": step, "loss": losses[0], "lr": 0.0, "grad_norm": float("inf"), "tokens_per_s": toks / dt,
               "step_ms": dt * 1e3, "loss_scale": self.scaler.scale, "skipped": True}
        if len(self.slots) > 1:
            out["models"] = [{"model": s.index, "loss": losses[s.index], "lr": 0.0, "grad_norm": float("inf")}
                             for s in self.slots]
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
        return list(self.pp.allreduce_(np.array(self.sync.loss_allreduce(totals))))

    def _sum_tied(self):
        """Sum the tied embedding's gradient between the first and last pipeline stage, then run the
        gradient sync of those blocks (deferred until now)."""
        for b, wte in self.tied.items():
            self.mesh.comms["tied"].allreduce_(self.sync.grads_for(b)[wte])
        self.sync.flush_deferred()

    def _sumsq(self, g, r):
        """Squared norm of the owned gradient in r, counting the last stage's wte copy zero times."""
        if r is None:
            return 0.0
        own = self.sync.owned
        total = sum_of_squares(self.xp, g[r.start - own.start:r.stop - own.start])
        for ex in self.norm_exclude:
            cut = ex.intersect(r)
            if cut is not None:
                total -= sum_of_squares(self.xp, g[cut.start - own.start:cut.stop - own.start])
        return total

    # --- state and accounting -------------------------------------------------------------------
    def full_params(self) -> np.ndarray:
        """The whole flat parameter vector on the host (gathered under stage 3)."""
        return self.sync.full_params()

    def memory(self) -> dict:
        return {"param_bytes": self.sync.param_bytes(), "grad_bytes": self.sync.grad_bytes(),
                "optim_bytes": sum(o.nbytes() for o in self.opts if o is not None)
                + (int(self.master.nbytes) if self.master is not None else 0),
                "transient_peak_bytes": self.sync.transient_peak,
                "activation_peak_bytes": self.cache_peak,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def n_params(self) -> int:
        return sum(int(np.prod(s.global_shape)) for s in self.layout.specs)
