"""Pipeline parallel: the model's blocks cut into p·v consecutive chunks (rank s holds chunks s, s+p, ...),
and the executor that walks this rank's schedule (schedules.py), moving activations forward and their
gradients backward with Isend/Irecv tagged by (micro-batch, virtual stage, direction).

Sends are non-blocking and receives complete in schedule order, so a schedule that simulates without
deadlock (tests/unit/test_schedules.py) runs without one here.
"""
from __future__ import annotations

import time

from ..buffers import partition
from ..comm import testall, waitall
from ..trace import OFF
from .schedules import make_schedule

FWD, BWD = 0, 1


class PipelineError(ValueError):
    pass


def split_blocks(model, p: int, v: int, split, param_count) -> list[list[str]]:
    """The model's block names cut into p·v consecutive chunks (embed in the first, head in the last).

    split: "uniform" (layers as even as possible), "params" (balanced by parameter count), or a list of
    layers per chunk."""
    names, L, P = model.block_names(), model.n_layers, p * v
    if P > L:
        raise PipelineError(f"pipeline.degree x virtual_stages = {p} x {v} = {P} chunks but the model has only "
                            f"{L} blocks (model.n_layers); use at most {L} chunks")
    if split == "params":
        rs = partition([param_count(b) for b in names], P, "tensor")
        sizes, out, i = [param_count(b) for b in names], [], 0
        for r in rs:
            chunk, acc = [], 0
            while i < len(names) and acc < r.size:
                chunk.append(names[i])
                acc += sizes[i]
                i += 1
            out.append(chunk)
        return out
    if split == "uniform":
        counts = [L // P + (1 if c < L % P else 0) for c in range(P)]
    else:
        counts = list(split)
        if len(counts) != P or sum(counts) != L or min(counts) < 1:
            raise PipelineError(f"pipeline.split = {counts}: needs {P} entries (degree x virtual_stages), each >= 1, "
                                f"summing to model.n_layers = {L}")
    chunks, start = [], 0
    for c, n in enumerate(counts):
        chunks.append([f"h.{i}" for i in range(start, start + n)])
        start += n
    chunks[0].insert(0, "embed")
    chunks[-1].append("head")
    return chunks


class PipelineExecutor:
    """Runs one pass (a share of the batch, split into micro-batches) of one model through this rank's
    schedule."""

    def __init__(self, engine, pp_comm, chunks_here, p, v, m, schedule):
        self.e, self.pp, self.p, self.v, self.m = engine, pp_comm, p, v, m
        self.stage = pp_comm.rank
        self.chunks = chunks_here                 # this rank's chunks, local index c = global g // p
        self.buffers = {}
        self.V = p * v
        self.actions = make_schedule(schedule, p, m, self.stage, v) if p > 1 or m > 1 else \
            make_schedule("fthenb", 1, 1, 0)
        self.busy_s, self.wall_s, self.peak_live = 0.0, 0.0, 0

    def _g(self, chunk):
        return chunk * self.p + self.stage

    def _tag(self, mb, g, direction):
        return (mb * self.V + g) * 2 + direction

    def _buffer(self, mb, g_dst, direction, shape):
        """Preallocated receive buffers, reused every step: one per (micro-batch, chunk) for activations
        (a recomputed block's cache keeps its input until that micro-batch's backward), one per chunk for
        gradients (consumed by the backward right away). Shapes come from the config: no shape exchange."""
        key = (mb if direction == FWD else -1, g_dst, direction, shape)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = self.e.xp.empty(shape, dtype=self.e.be.dtype)
        return buf

    def _recv(self, mb, g_src, g_dst, direction, shape):
        buf = self._buffer(mb, g_dst, direction, shape)
        t = self.tr.now()
        self.pp.irecv(buf, source=g_src % self.p, tag=self._tag(mb, g_dst, direction)).Wait()
        self.tr.lap("pipeline idle", t, "wait F" if direction == FWD else "wait B", (mb, g_dst))  # issue 11
        return buf

    def run(self, slot, x, y, norm, last_pass: bool, grad: bool = True) -> float:
        """Forward (and backward) of every micro-batch of rows x, y; returns the loss share (last stage)."""
        e, m, V = self.e, self.m, self.V
        rows = x.shape[0] // m
        act_shape = (rows, x.shape[1], e.cfg.model.d_model)
        actions = self.actions if grad else [a for a in self._forward_only()]
        caches, sends, loss, live = {}, [], 0.0, 0
        self.tr = tr = e.tracer if grad else OFF   # issue 11: timeline spans; evaluation is one span in train.py
        t_start = time.perf_counter()
        for a in actions:
            g, chunk, mb = self._g(a.chunk), self.chunks[a.chunk], a.mb
            sl = slice(mb * rows, (mb + 1) * rows)
            if a.kind == "F":
                inp = x[sl] if g == 0 else self._recv(mb, g - 1, g, FWD, act_shape)
                t0, t = time.perf_counter(), tr.now()
                out, cache = e.chunk_forward(slot, chunk, inp, y[sl] if g == V - 1 else None, norm, grad)
                tr.lap("forward", t, "F", (mb, g))
                self.busy_s += time.perf_counter() - t0
                if grad:
                    caches[(mb, a.chunk)] = cache
                    live += 1
                    self.peak_live = max(self.peak_live, live)
                if g == V - 1:
                    loss += float(out)
                else:
                    sends.append(self.pp.isend(out, dest=(g + 1) % self.p, tag=self._tag(mb, g + 1, FWD)))
            else:
                e.sync.begin_pass(last_pass and mb == m - 1)   # the last backward of a chunk finishes its grads
                dout = None if g == V - 1 else self._recv(mb, g + 1, g, BWD, act_shape)
                t0, t = time.perf_counter(), tr.now()
                din = e.chunk_backward(slot, chunk, dout, caches.pop((mb, a.chunk)))
                tr.lap("backward", t, "B", (mb, g))
                self.busy_s += time.perf_counter() - t0
                live -= 1
                if g > 0:
                    sends.append(self.pp.isend(din, dest=(g - 1) % self.p, tag=self._tag(mb, g - 1, BWD)))
            testall(sends)
        if sends:
            t = tr.now()
            waitall(sends)
            tr.lap("pipeline idle", t, "drain sends")
        self.wall_s += time.perf_counter() - t_start
        return loss

    def _forward_only(self):
        from .schedules import Action
        return [Action("F", mb, c) for mb in range(self.m) for c in range(self.v)]
