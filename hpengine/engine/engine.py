"""The engine: this rank's model stage (one or several models sharing one flat buffer and one partition),
the gradient-sync strategy, the owned-shard optimizer, and one optimizer step read top to bottom:
passes -> reduced gradients -> global norms -> update -> metrics.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import resource
import time

import numpy as np
from mpi4py import MPI

from hpengine.dist.comm import Comm
from hpengine.dist.topology import REPLICA
from hpengine.dist.tracer import Tracer
from hpengine.engine import outer_state, state
from hpengine.engine.held import held_state as _held_state, restore_held as _restore_held
from hpengine.engine.rows import RowReader
from hpengine.models import capabilities
from hpengine.models.context import Ahead, with_documents
from hpengine.models.moe_bias import RouterBias
from hpengine.models.moe_figures import MoEFigures
from hpengine.layout.cache import ChunkCaches, Recompute, cache_nbytes
from hpengine.layout.reduction import reductions, summed_over, tied_sums
from hpengine.layout.stage import build_stage
from hpengine.nn import run_all
from hpengine.optim import clip_coefficient, lr_at, make_optimizer, optimizer_kind, post_update
from hpengine.params.buffers import Range, cut
from hpengine.params.init import init_parts
from hpengine.strategies import make_grad_sync
from hpengine.strategies.amp import Precision
from hpengine.strategies.context import make_context
from hpengine.strategies.diloco import Outer, block_max, fragment_of, fragment_plans, fragment_slices
from hpengine.strategies.norm import GlobalNorm
from hpengine.strategies.pipeline import PipelineExecutor

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


class Engine:
    def __init__(self, cfg, res, mesh, backend, dataset):
        self.cfg, self.res, self.mesh, self.be, self.data = cfg, res, mesh, backend, dataset
        self.xp = backend.xp
        amp = cfg.strategy.amp
        # what amp rounds, where (bf16 caches packed in 2 bytes: amp.bf16_storage); the loss scaler; the
        # precision policy the context hands the layers
        self.precision = Precision(amp, res.amp, res.packs_activations(backend.is_gpu))
        self.ctx = make_context(res, mesh.comms, cfg.model.vocab_size, backend.xp, cfg.model.seq_len,
                                self.precision.numerics)
        self.tp = self.ctx.tp
        t = cfg.train
        seeds = tuple(t.model_seeds or [t.seed + i for i in range(t.models)])
        lrs = tuple(t.model_lrs or [cfg.optim.lr] * t.models)
        self.stage = build_stage(cfg.model, res, mesh.coords["pp"], self.tp.rank, seeds, lrs,
                                 ep_rank=mesh.comms["ep"].rank if res.ep > 1 else 0)
        self.layout, self.slots = self.stage.layout, self.stage.slots
        self.sync = make_grad_sync(res, self.stage, backend, mesh.comms, self.precision.storage)
        self.world = Comm(mesh.world, "world", backend)
        # what one island decides together (amp's vote, a non-finite step, the qk clip's maxima): the world
        # without DiLoCo
        self.inner = self.world if mesh.islands == 1 else mesh.island()
        self.pp = mesh.comms["pp"]
        self.amp, self.scaler = res.amp, self.precision.scaler
        # amp: float32 master weights of the owned range, from the exact (unrounded) initial values: a copy of
        # the held ones while they are still float32 or wider (the storage converts them, and bf16 rounds them,
        # only below), else hashed again (float16's compute copy has lost them); a second hashing pass costs
        # ~30 s for 1 B parameters
        held = self.sync.owned_params() if self.amp else None
        parts = self.sync.owned_parts
        self.master = (None if held is None else held.astype(np.float32) if held.dtype.itemsize >= 4
                       else init_parts(self.layout, t.seed, parts, self.xp, np.float32))
        self.sync.store_params()        # packed: the compute copy in 2 bytes, bfloat16 bits of the values init wrote
        self._round_held_params()
        # per tensor: the sums that make its gradient whole and whether it counts in the norm here
        self.reductions = reductions(self.stage, self.tp.rank, res.sp, res.cp > 1)
        self.tied = tied_sums(self.reductions, self.stage)
        self.norm = GlobalNorm(self.layout, self.reductions, parts, mesh.comms, self.xp, res.sh > 1,
                               res.experts_whole)
        own = self.sync.owned
        self.replicated = [(at, at + c.size) for n in summed_over(self.reductions, "tp")
                           for c, at in cut(parts, self.layout.ranges[n])]
        # one optimizer per model and owned part: (slot, flat Range, offset in the owned arrays); None where a
        # model has nothing here
        self.segs = [(s, seg, at) for s in self.slots for seg, at in (cut(parts, s.range) or [(self._none(s), 0)])]
        self.opts = [self._optimizer(seg) for _, seg, _ in self.segs]
        # what runs after each update (the qk clip: the layers report their largest logits through the context)
        self.post = post_update(cfg.optim, self.slots[0].model, self.layout, own, self.xp, backend.to_host,
                                lambda a: self.inner.allreduce_(a, op=MPI.MAX), self.tp.rank, self.tp.size)
        self.ctx = self.post.context(self.ctx)
        self.share = res.share
        self.cache_bytes = self.cache_peak = 0
        self.layer_loss, self._norm = 0.0, 1.0
        # the first model's figures, as `loss` is (every model's loads when router biases follow them)
        self.moe = MoEFigures(self.slots[0].model, self.xp, len(self.slots))
        self.router_bias = RouterBias([s.model for s in self.slots], cfg.model.moe.bias_update_rate, self.xp)
        self.opt_steps = 0          # optimizer updates applied (a checkpoint restores each optimizer's count)
        self.unit_lr = dataclasses.replace(cfg.optim, lr=1.0)
        self.pipe = PipelineExecutor(self.pp, self.xp, backend.dtype, res.pp, res.v, res.m, res.schedule,
                                     cfg.model.d_model, res.seq_parts, mesh.comms["tp"] if res.scatter else None,
                                     wire_bits=self.precision.packed)
        # multi-token prediction: its targets ride on the training rows, its losses on the loss allreduce
        self.mtp_depth = capabilities(cfg.model).mtp_depth
        self._ahead, self._mtp = (), [[] for _ in self.slots]
        self.rows = RowReader(dataset, backend, t.global_batch, cfg.model.seq_len, res.share,
                              res.replica(mesh.coords) * res.share, self.pipe.reads_rows(), mesh.comms["tp"],
                              res.cp, mesh.coords["cp"], self.mtp_depth)
        # DiLoCo: an island's loss is its rows' share of the global batch's times the islands (its own mean);
        # it evaluates the whole validation batch, split over its own replicas only
        self.islands = res.islands
        self.val_rows = self.rows if res.islands == 1 else RowReader(
            dataset, backend, t.global_batch, cfg.model.seq_len, res.share * res.islands,
            res.replica({**mesh.coords, REPLICA: 0}) * res.share * res.islands, self.pipe.reads_rows(),
            mesh.comms["tp"], res.cp, mesh.coords["cp"], self.mtp_depth)
        self.outer = self._outer(cfg.strategy.diloco, parts)
        self.outer_figures = {}
        self.tracer = Tracer()      # the run hands in its own (attach_tracer)
        self.before_update = None   # fence_updates: called before a step changes parameters or optimizer state

    def _outer(self, dl, parts):
        """DiLoCo's outer state over the owned part (None without islands)."""
        if self.islands == 1:
            return None
        p0 = self.master if self.master is not None else self.sync.owned_params()
        of = fragment_of(state.reference_order_specs(self.slots), dl.fragments)     # the whole model's tensors
        plans = fragment_plans(parts, self.layout, of, dl.fragments) if dl.quantize != "none" else None
        # int8/int4 blocks are whole tensors': their scales' MAX over the island's ranks holding parts of a tensor
        cutting = [self.mesh.comms["tp"]] + ([self.mesh.comms["sharding"]] if self.res.partition == "flat" else [])
        return Outer(dl, self.mesh.comms[REPLICA], self.xp, p0, fragment_slices(parts, self.layout, of, dl.fragments),
                     plans, block_max(cutting))

    def _optimizer(self, seg):
        dtype = self.precision.master_dtype(self.be.dtype)
        return None if seg is None else make_optimizer(self.cfg.optim, self.xp, self.layout, seg, dtype, self.sync.whole)

    def _none(self, slot):
        """A model's part where this rank owns none of it: None, or an empty Range at the model's start when
        whole-tensor work is divided (every rank takes part in each model's exchange)."""
        return Range(slot.range.start, slot.range.start) if self.sync.whole is not None else None

    # --- forward / backward ---------------------------------------------------------------------
    def _P(self, slot, b, nxt=None):
        buf = self.precision.layer_params(self.xp, self.sync.params_for(slot.prefix + b, nxt and slot.prefix + nxt),
                                          slot.model.gemm_weight, self.stage.block_specs[slot.prefix + b])
        return Prefixed(buf, slot.prefix) if slot.prefix else buf

    def _G(self, slot, b):
        buf = self.sync.grads_for(slot.prefix + b)
        return Prefixed(buf, slot.prefix) if slot.prefix else buf

    def chunk_forward(self, slot, chunk, h, batch, norm: float, grad: bool = True):
        """Forward of one chunk (consecutive block names) of one model on h (the first chunk: the micro-batch's
        tokens) and the micro-batch's Batch; the head returns the loss of its targets.
        A recomputed block keeps only its input (or, selective, all but its attention probabilities);
        backward rebuilds the rest."""
        xp, m, ctx = self.xp, slot.model, with_documents(self.ctx, batch)
        if grad and self._ahead and batch.ahead is not None:     # a training pass: multi-token prediction's targets
            ctx = dataclasses.replace(ctx, ahead=Ahead(batch.ahead, self._ahead, self.precision.loss_scale,
                                                       self._mtp[slot.index].append))
        caches = ChunkCaches(ctx)
        for n, name in enumerate(chunk):
            b, nxt = slot.block(name), chunk[n + 1] if n + 1 < len(chunk) else None
            h_in = h
            if b.kind == "embed":
                h, c = m.embed_forward(xp, self._P(slot, name, nxt), h, ctx)
            elif b.kind == "head":
                h, c = m.head_forward(xp, self._P(slot, name), h, batch.targets, norm, ctx)
            else:
                h, c = m.layer_forward(xp, self._P(slot, name, nxt), b.layer, h, ctx,
                                       keep_scores=not self.res.drops_scores(b), loss=self._loss_args(norm, grad))
                st = m.layer_stats(b.layer, c)
                if st is not None and grad:          # an MoE layer: its balancing losses join the loss
                    self.layer_loss += st.share
                    self.moe.add(b.layer, st, slot.index)
                if self.res.recomputed(b):
                    c = Recompute(h_in)
            c = self.precision.stored_activations_(xp, b.kind, h, c if grad else None, self.sync.param_roots())
            self.sync.release(slot.prefix + name)
            caches.append(c)
        if grad:
            self._count_caches(caches, +1)
        return h, caches

    def chunk_backward(self, slot, chunk, d, caches, defer=None):
        """Backward of one chunk; returns the gradient of its input (None for the embedding). With `defer` (a
        list) it is the input half B of a split backward: each block's weight-gradient work goes on defer as
        (block, works), for chunk_weights to run, and the block's gradients are finished there."""
        xp, m, ctx = self.xp, slot.model, caches.ctx
        self._count_caches(caches, -1)
        for n in reversed(range(len(chunk))):
            b, c = slot.block(chunk[n]), self.precision.unpacked(xp, caches[n])    # float32 for this block only
            caches[n] = None
            # stage 3 gathers the block's parameters again here, prefetching the block before it
            prev = chunk[n - 1] if n and slot.block(chunk[n - 1]).bwd_params else None
            works = None if defer is None else []
            if b.kind == "head":
                d = m.head_backward(xp, c, self._G(slot, b.name), ctx, self._P(slot, b.name, prev),
                                    self.precision.loss_scale, works)
                self.precision.input_grad_(xp, d)
            elif b.kind == "embed":
                m.embed_backward(xp, d, c, self._G(slot, b.name), ctx, works)
                d = None
            else:
                P = self._P(slot, b.name, prev)
                if isinstance(c, Recompute):     # rebuild this block's activations from its input
                    _, c = m.layer_forward(xp, P, b.layer, c.x, ctx, loss=self._loss_args(self._norm, True))
                d = m.layer_backward(xp, d, c, P, self._G(slot, b.name), b.layer, ctx, works)
                self.precision.input_grad_(xp, d)
            self.sync.release(slot.prefix + b.name)
            if defer is None:
                self._block_grads_done(slot, b.name)
            else:
                defer.append((b.name, works))
        if defer is not None:
            self._count_stash(defer, +1)
        return d

    def chunk_weights(self, slot, defer) -> None:
        """The weight half W of a split chunk backward: the work chunk_backward put on defer, block by block in
        backward order; each block's gradients are then finished (rounded under bf16 gradients, reduced)."""
        self._count_stash(defer, -1)
        for name, works in defer:
            run_all(works)
            self._block_grads_done(slot, name)

    def _block_grads_done(self, slot, name) -> None:
        self.sync.grads_done(slot.prefix + name)      # bfloat16 gradients: rounded (packed: stored as bits)
        self.sync.block_done(slot.prefix + name)

    def _loss_args(self, norm: float, grad: bool):
        """What a layer with a loss of its own (an MoE layer's balancing losses) is handed: (norm, loss scale)."""
        return (norm, self.precision.loss_scale) if grad else None

    def _count_caches(self, caches, sign: int) -> None:
        """Bytes of live activation caches (parameters they reference are not counted)."""
        self.cache_bytes += sign * cache_nbytes(caches, self.sync.param_roots())
        self.cache_peak = max(self.cache_peak, self.cache_bytes)

    def _count_stash(self, defer, sign: int) -> None:
        """Bytes of a split backward's W stash: what its deferred work alone still holds."""
        self.cache_bytes += sign * cache_nbytes([w.held for _, ws in defer for w in ws], self.sync.param_roots())
        self.cache_peak = max(self.cache_peak, self.cache_bytes)

    def forward_backward(self, slot, batch, norm: float, grad: bool = True, last_pass: bool = True,
                         ahead: tuple = ()) -> float:
        """One pass of one model over a Batch of rows (split into micro-batches, through the pipeline when it
        is on); returns this rank's share of the global-mean loss. ahead: the loss divisors of multi-token
        prediction's depths (a training pass of a model with it)."""
        fwd = lambda chunk, h, t, g: self.chunk_forward(slot, chunk, h, t, norm, g)  # noqa: E731
        bwd = lambda chunk, d, c, defer: self.chunk_backward(slot, chunk, d, c, defer)  # noqa: E731
        wgt = lambda chunk, defer: self.chunk_weights(slot, defer)  # noqa: E731
        self._norm, self.layer_loss, self._ahead = norm, 0.0, ahead
        ce = self.pipe.run(slot.chunks, fwd, bwd, self.sync.begin_pass, batch, last_pass, grad, self.tracer, wgt)
        return ce + self.layer_loss

    # --- one optimizer step ---------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        """One optimizer step of every model. Returns the metrics of the step (same on every rank);
        with several models, 'models' holds one entry per model."""
        t0, tr = time.perf_counter(), self.tracer
        losses = self._passes(step)
        t = tr.now()
        g = self._reduced_grads()
        t = tr.lap("grad sync wait", t)
        if self.before_update is not None:
            self.before_update()
        if g is None:              # amp overflow somewhere: every rank skips this step together
            self.scaler.update(False)
            log.warning("step %d: gradient overflow, step skipped on every rank; loss scale -> %g",
                        step + 1, self.scaler.scale)
            collapsed = self.scaler.collapsed()      # the same scaler state on every rank: they stop together
            if collapsed:
                raise NonFiniteError(f"step {step + 1}: {collapsed}")
            self._outer_step(step, *self._views())       # the islands meet whether or not this one stepped
            self.sync.share_params()
            out = self._metrics(step, t0, self._losses(losses), [float("inf")] * len(self.slots), 0.0, skipped=True)
            out.update(self._outer_metrics())
            return out
        norms = self.norm.norms(g, self.slots)
        if not np.isfinite(norms).all():      # the same reduced values on every rank: a collective decision
            self._report_non_finite(step, losses, g)
        p, copy = self._views()
        lr_scale = self._update(g, norms, step, p, copy)
        t = tr.lap("optimizer", t)
        if self._outer_step(step, p, copy):
            t = tr.lap("outer step", t)
        self.sync.share_params()
        t = tr.lap("param share", t)
        # the MoE layers' figures ride on the loss allreduce: one collective whatever the model
        n, mtp = len(losses), self._mtp_losses()
        summed = self._losses(losses + mtp + self.moe.values(self.be.to_host))
        losses, mtp, n = summed[:n], summed[n:n + len(mtp)], n + len(mtp)
        moe = self.moe.metrics(summed[n:])
        if moe:         # an applied step (a skipped one returned above): the router biases follow its loads
            self.router_bias.update(self.moe.loads(summed[n:]))
        self.be.sync()
        tr.lap("loss sync", t)
        out = self._metrics(step, t0, losses, norms, lr_scale)
        out.update(self._outer_metrics())
        if mtp:         # the first model's, as `loss` is
            out["mtp_loss"] = mtp[0]
        out.update(moe)
        return out

    def _mtp_losses(self) -> list[float]:
        """This rank's share of every model's multi-token prediction loss (the mean of its depths' unweighted
        cross-entropies) in this step; [] without it."""
        return [float(sum(float(v) for v in parts)) for parts in self._mtp] if self.mtp_depth else []

    def _passes(self, step: int) -> list[float]:
        """Forward and backward of the step's k passes of every model; this rank's loss shares."""
        tr, t = self.tracer, self.tracer.now()
        # the targets each model counts (an island: its share of the global batch's)
        norms = [self.rows.norm("train", step, s.seed) / self.islands for s in self.slots]
        ahead = [tuple(a / self.islands for a in self.rows.ahead_norms("train", step, s.seed)) for s in self.slots]
        for parts in self._mtp:
            parts.clear()
        batches = [self.rows.read("train", step, s.seed) for s in self.slots]
        tr.lap("data", t)
        self.sync.begin_step()
        losses, k = [0.0] * len(self.slots), self.res.k
        self.moe.reset()
        self.post.begin_step()
        rows = self.share // k
        # under amp an overflow is expected and handled (the step is skipped): no NumPy warnings for it
        with np.errstate(over="ignore", invalid="ignore") if self.scaler else contextlib.nullcontext():
            for j in range(k):
                for s, b in zip(self.slots, batches):
                    losses[s.index] += self.forward_backward(s, b.row_slice(j * rows, (j + 1) * rows), norms[s.index],
                                                             last_pass=(j == k - 1), ahead=ahead[s.index])
        return losses

    def _reduced_grads(self):
        """The owned gradient summed over replicas and tied copies (float32 and unscaled under amp);
        None when amp saw an overflow on any rank."""
        for r in self.tied:                  # a tied copy first, then the replicas, then (sp) tp
            self.mesh.comms["tied"].allreduce_(self.sync.grads_for(r.block)[r.tensor])
            self.sync.grads_done(r.block)
        self.sync.flush_deferred()
        g = self.sync.reduce_grads()
        self.ctx.seq.sum_replicated_(g, self.replicated)
        return self.precision.ready_grad(self.xp, g, lambda ok: self.inner.allreduce_obj(ok, op=MPI.LAND))

    def _views(self) -> tuple:
        """(what the optimizer updates: the owned parameters, or the float32 masters under amp; amp's compute copy
        of them, None without amp), asked once a step (a sync may hand out a fresh copy each time)."""
        p = self.sync.owned_params() if self.master is None else self.master
        # amp: the optimizer writes the compute copy (float16, float32 holding bf16 values, or packed their bits)
        # in its pass
        copy = self.sync.owned_params() if self.master is not None else None
        return p, copy

    def _outer_step(self, step: int, p, copy) -> bool:
        """DiLoCo: the fragments due after `step` meet (under overlap: start, and the ones started H / F steps ago
        land); whether any did."""
        events = self.outer.advance(step, p, copy) if self.outer is not None else []
        for drift, avg in events:       # under overlap an exchange's start (drift) and landing (avg) are apart
            self.outer_figures["outer_step"] = self.outer.steps
            for k, a in (("outer_drift", drift), ("outer_grad_norm", avg)):
                if a is not None:
                    self.outer_figures[k] = self.norm.norms(a, self.slots)[0]
        return bool(events)

    def _outer_metrics(self) -> dict:
        """The last outer step's figures (this island's drift), once, and the replica bytes so far."""
        if self.outer is None:
            return {}
        out, self.outer_figures = {"outer_step": self.outer.steps, **self.outer_figures}, {}
        out["replica_bytes"] = sum(b for _, b in self.mesh.comms[REPLICA].stats.values())
        return out

    def _update(self, g, norms, step: int, p, copy) -> float:
        """The clipped optimizer step on the owned range of every model (on the float32 masters under amp);
        returns the schedule's factor."""
        lr_scale = lr_at(step, self.unit_lr, self.cfg.train.steps)     # each model has its own peak lr
        for (s, seg, at), opt in zip(self.segs, self.opts):
            if opt is not None:
                sl = slice(at, at + seg.size)
                opt.step(p[sl], g[sl], s.lr * lr_scale, clip_coefficient(norms[s.index], self.cfg.optim.clip_grad_norm),
                         None if copy is None else copy[sl])
        self.post.apply(p, copy)
        if self.scaler is not None:
            self.scaler.update(True)
        self.opt_steps += 1
        return lr_scale

    def _losses(self, losses: list) -> list[float]:
        """The global-mean loss of every model, the same on every rank."""
        return list(self.pp.allreduce_(np.array(self.sync.loss_allreduce(losses))))

    def _metrics(self, step, t0, losses, norms, lr_scale, skipped=False) -> dict:
        dt = time.perf_counter() - t0
        per = [{"model": s.index, "loss": losses[s.index], "lr": s.lr * lr_scale, "grad_norm": norms[s.index]}
               for s in self.slots]
        toks = self.cfg.train.global_batch * self.cfg.model.seq_len * len(self.slots)
        out = {"step": step + 1, **{k: v for k, v in per[0].items() if k != "model"},
               "tokens_per_s": toks / dt, "step_ms": dt * 1e3}
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.scale
        if skipped:
            out["skipped"] = True
        if len(self.slots) > 1:
            out["models"] = per
        return out

    def _report_non_finite(self, step, losses, g):
        """A NaN/inf loss or gradient is reported with the step and the ranks that saw it, never trained on.
        A rank saw it where its loss share, its gradient or its gradient's squares are not finite (finite
        float64 gradients beyond 1e154 square to inf); when every share is finite and only their sum
        overflowed, the ranks with the largest share are named."""
        squares = self.norm.here(g, self.slots)
        bad = not (np.isfinite(losses).all() and bool(self.xp.isfinite(g).all()) and np.isfinite(squares))
        seen = self.inner.allgather_obj((bad, squares))
        ranks = [r for r, (b, _) in enumerate(seen) if b]
        if not ranks:
            top = max(sq for _, sq in seen)
            ranks = [r for r, (_, sq) in enumerate(seen) if sq == top]
        raise NonFiniteError(f"step {step + 1}: non-finite loss or gradient on rank(s) {ranks} "
                             f"(losses here: {losses}; squared gradient norm here: {squares:.3g}); stopping "
                             "instead of training on it")

    def evaluate(self) -> list[float]:
        """Validation loss of every model on the first eval_batches validation batches."""
        cfg = self.cfg
        totals = [0.0] * len(self.slots)
        for s in self.slots:
            norm = sum(self.val_rows.norm("val", i, s.seed) for i in range(cfg.train.eval_batches))
            for i in range(cfg.train.eval_batches):
                totals[s.index] += self.forward_backward(s, self.val_rows.read("val", i, s.seed), norm, grad=False)
        return self._losses(totals)

    # --- state and accounting -------------------------------------------------------------------
    def named_params(self) -> dict:
        """Every tensor of every model as its whole global array (collective; for comparing layouts)."""
        return state.named_params(self.stage, self.sync, self.tp, self.mesh.comms)

    def true_shapes(self) -> dict:
        return state.true_shapes(self.slots)

    def state_pieces(self, copy: bool = True) -> tuple[list, dict]:
        """What this rank saves of the training state, as load() takes it back: the pieces it alone writes
        (owned parameters, float32 masters under amp, the optimizer's state tensors) and the layout-independent
        facts (optimizer steps and state names, loss scaler, router biases, tensor shapes, degrees). The caller adds config and data.
        copy=False: the pieces view the live buffers (valid until `before_update` returns)."""
        c, d = self.mesh.coords, self.mesh.degrees
        ep, edp = self.stage.layout.ep_size, self.mesh.comms.get("ep-dp")
        # the ranks holding the same expert block: its ep-dp replicas (dp ranks e, e + ep, ... under cp's)
        experts = ((edp.rank, edp.size) if self.res.experts_whole else
                   ((c["dp"] // ep) * d["cp"] + c["cp"], (d["dp"] // ep) * d["cp"]))
        replica = {"dp": c["dp"], "ndp": d["dp"], "cp": c["cp"], "ncp": d["cp"], "experts": experts}
        elsewhere = frozenset(r.tensor for r in self.reductions if not r.counted)
        pieces = state.checkpoint_pieces(self.stage, self.sync, self.segs, self.opts, self.master, replica, self.be,
                                         elsewhere, copy)
        opt_state = optimizer_kind(self.cfg.optim.name).state
        meta = {"state": {**state.checkpoint_meta(self.opt_steps, self.scaler, len(self.slots)), **self.router_bias.meta()},
                "shapes": self.true_shapes(), "layout": self.mesh.degrees, "world": self.mesh.size,
                "optimizer": {"name": self.cfg.optim.name, "state": list(opt_state)}}
        if self.outer is not None:      # DiLoCo: the outer state, and each island's under its own names
            self.outer.settle()         # exchanges on the wire complete into outer.pending
            pieces = outer_state.island_pieces(pieces, c[REPLICA], self.outer, self.stage, self.sync, self.segs,
                                               replica, self.be, elsewhere, copy)
            meta["optimizer"]["state"] = outer_state.kinds(opt_state, self.islands, self.outer)
            meta["state"]["outer_steps"] = self.outer.steps
        return pieces, meta

    def load(self, reader, params_only: bool = False) -> None:
        """This rank's part of a checkpoint (or of an export's parameters) into the engine."""
        island = self.mesh.coords.get(REPLICA, 0)
        if self.outer is not None and not params_only and outer_state.holds_island(reader, island):
            steps = outer_state.load_islands(reader, island, self.outer, self.stage, self.sync, self.segs, self.opts,
                                             self.master, self.tp, self.be)
        else:
            steps = state.load_state(self.stage, self.sync, self.segs, self.opts, self.master, self.tp, self.be, reader,
                                     params_only)
            if self.outer is not None:      # a fresh outer loop from the loaded parameters
                self.outer.reset(self.master if self.master is not None else self.sync.owned_params())
        manifest = getattr(reader, "manifest", None)     # a checkpoint's, a Hugging Face folder's with router biases
        if manifest is not None:        # the router biases route as the parameters were trained to
            self.router_bias.load(manifest["state"])
        if steps is not None:
            self.opt_steps = steps
            saved = reader.manifest["state"].get("loss_scaler")
            if self.scaler is not None and saved:
                self.scaler.load(saved)
        self._round_held_params()

    def held_state(self) -> tuple[dict, dict]:
        """This rank's state as host copies and small facts, for a buddy copy (engine/held.py)."""
        return _held_state(self)

    def restore_held(self, arrays: dict, facts: dict) -> None:
        """Take back what held_state gave (of this rank, or of the rank whose mesh place this one took)."""
        _restore_held(self, arrays, facts)

    def _round_held_params(self) -> None:
        """bf16: the compute copy this rank holds (whole buffer and owned shard) as bfloat16 values (packed: bits
        already); local, and the same on every replica, since each holds the same unrounded values."""
        self.precision.held_params_(self.xp, (getattr(self.sync.params, "data", None), self.sync.owned_params()))

    def memory(self) -> dict:
        return {"param_bytes": self.sync.param_bytes(), "grad_bytes": self.sync.grad_bytes(),
                "optim_bytes": sum(o.nbytes() for o in self.opts if o is not None)
                + (int(self.master.nbytes) if self.master is not None else 0),
                "transient_peak_bytes": self.sync.transient_peak,
                "activation_peak_bytes": self.cache_peak,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def n_params(self) -> int:
        return sum(int(np.prod(s.global_shape)) for s in self.layout.specs)

    def param_counts(self) -> tuple[int, int]:
        """(parameters of the whole model, of this pipeline stage), every tensor counted once (a copy of
        another stage's tensor, such as the tied head's wte, counts there). Collective on the pp axis."""
        mine = sum(int(np.prod(s.global_shape)) for s in self.layout.specs if s.name not in self.stage.copies)
        return (sum(self.pp.allgather_obj(mine)) if self.res.pp > 1 else mine), mine

    # --- what the training loop asks of it ------------------------------------------------------
    def fence_updates(self, fn) -> None:
        """fn() runs before each step changes parameters or optimizer state (an asynchronous save's fence);
        None: nothing does."""
        self.before_update = fn

    def attach_tracer(self, tracer) -> None:
        """The run's phase timers (and timeline under runtime.trace) from now on."""
        self.tracer = tracer

    def describe(self) -> tuple[str, int]:
        """(the gradient sync's one log line, "" when it has nothing to say; this rank's blocks)."""
        return self.sync.describe(), len(self.stage.blocks)

    def comm_names(self) -> dict:
        """{"grads": [...], "params": [...]}: the communicators gradients and parameters travel over."""
        names = self.sync.comm_names()
        return {"grads": names["grads"] + (["tied"] if self.stage.tied else []), "params": names["params"]}

    def pipeline_stats(self) -> list[tuple[float, int]] | None:
        """Per pipeline stage, (measured bubble: the idle share of the executor's wall time, peak live activation
        caches); None before the pipeline ran. Collective on the pp axis."""
        pipe = self.pipe
        if pipe.wall_s == 0:
            return None
        return self.pp.allgather_obj((1.0 - pipe.busy_s / pipe.wall_s, pipe.peak_live))
