"""Pipeline parallel: the executor that walks this rank's schedule (schedules.py), moving activations
forward and their gradients backward with Isend/Irecv tagged by (micro-batch, virtual stage, direction).
Which blocks each stage holds is decided in resolve.py (split_blocks).
"""
from __future__ import annotations

import time

import numpy as np

from hpengine.device.bf16_bits import from_bf16_bits, to_bf16_bits
from hpengine.dist.comm import testall, waitall
from hpengine.dist.tracer import OFF
from hpengine.layout.schedules import Action, make_schedule, placement, splits_backward

FWD, BWD = 0, 1


# Sends are non-blocking and receives complete in schedule order, so a schedule that simulates without
# deadlock (tests/unit/test_schedules.py, test_zero_bubble.py) runs without one here. Each (global chunk
# received, direction) is one channel of the pp communicator (NCCL's under runtime.collectives = "nccl",
# which matches by issue order): in every schedule both ends take its micro-batches in the same order
# (tests/unit/test_pipeline_channels.py). A zero-bubble schedule splits each backward: B hands the executor
# the chunk's weight-gradient work, W runs it later. Under ZB-V the two chunks that meet on the last rank pass
# activations and gradients to each other in memory.
class PipelineExecutor:
    """Walks this rank's schedule for one pass (a share of the batch split into micro-batches) of one
    model. It is handed the forward and backward of a chunk as callables, never the engine:
    forward(chunk, x, batch, grad) -> (out, cache), x the micro-batch's tokens (first chunk) or the
    activations received, batch its data.Batch (the last chunk reads its targets); backward(chunk, dout,
    cache, defer) -> din, with defer None (fused) or a list the chunk's weight-gradient work goes on;
    weight(chunk, defer) runs that list (a zero-bubble W); begin_pass(last) tells the gradient sync whether
    the backward (or W) that follows finishes the step's gradients."""

    def __init__(self, pp_comm, xp, dtype, p: int, v: int, m: int, schedule: str, width: int, seq_parts: int = 1,
                 split_comm=None, wire_bits: bool = False):
        self.pp, self.xp, self.dtype, self.p, self.v, self.m, self.width = pp_comm, xp, dtype, p, v, m, width
        # packed bf16 storage: what crosses stages (block outputs, input gradients: bfloat16 values in float32)
        # travels as its bfloat16 bits, half the bytes, and is float32 again on arrival (exactly)
        self.wire_bits = wire_bits
        self.in_flight = []             # the bits of sends not yet complete
        self.seq_parts = seq_parts      # sequence parallel: a stage's activations hold T / tp positions
        self.split = split_comm         # scatter/gather: the tp Comm whose ranks send 1/tp each
        self.stage = pp_comm.rank
        self.buffers, self.local = {}, {}
        self.V = p * v
        self.place = placement(schedule, p, v)
        self.split_bw = splits_backward(schedule)
        self.actions = make_schedule(schedule, p, m, self.stage, v) if p > 1 or m > 1 else \
            make_schedule("fthenb", 1, 1, 0)
        self.busy_s, self.wall_s, self.peak_live = 0.0, 0.0, 0
        # the last run's (start, end, busy) seconds on the host's monotonic clock, which every rank on a
        # node shares: with the other stages' it gives the pipeline-wide bubble (benchmarks/bench_zero_bubble.py)
        self.last_run = (0.0, 0.0, 0.0)
        self.tr = OFF
        if p > 1:       # every pp rank builds its executor at the same point of building the engine
            pp_comm.open_channels(self.channels())

    def channels(self) -> list:
        """Every stage's (sender, receiver, (global chunk received, direction)): the same list on every rank."""
        st = self.place.stage_of
        return [(st(g - 1), st(g), (g, FWD)) for g in range(1, self.V)] + \
               [(st(g + 1), st(g), (g, BWD)) for g in range(self.V - 1)]

    def _g(self, chunk):
        return self.place.virtual(self.stage, chunk)

    def _tag(self, mb, g, direction):
        return (mb * self.V + g) * 2 + direction

    def _buffer(self, mb, g_dst, direction, shape):
        """Preallocated receive buffers, reused every step: one per (micro-batch, chunk) for activations
        (a recomputed block's cache keeps its input until that micro-batch's backward), one per chunk for
        gradients (consumed by the backward right away; one per micro-batch too when the backward is split,
        since the weight-gradient work W keeps the gradient until it runs). Shapes come from the config: no
        shape exchange."""
        key = (mb if direction == FWD or self.split_bw else -1, g_dst, direction, shape)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = self.xp.empty(shape, dtype=np.uint16 if self.wire_bits else self.dtype)
        return buf

    def _piece(self, arr):
        """This tp rank's 1/tp of arr's elements (scatter/gather), else arr."""
        if self.split is None:
            return arr
        flat, n = arr.reshape(-1), arr.size // self.split.size
        return flat[self.split.rank * n:(self.split.rank + 1) * n]

    def _recv(self, mb, g_src, g_dst, direction, shape):
        src = self.place.stage_of(g_src)
        if src == self.stage:       # ZB-V's turn: the other chunk here made it
            return self.local.pop((mb, g_dst, direction))
        buf = self._buffer(mb, g_dst, direction, shape)
        t = self.tr.now()
        self.pp.irecv(self._piece(buf), source=src, tag=self._tag(mb, g_dst, direction),
                      channel=(g_dst, direction)).Wait()
        if self.split is not None:      # every tp rank of the sender sent its piece to its peer here
            n = buf.size // self.split.size
            self.split.allgatherv_(buf.reshape(-1), [n] * self.split.size, [r * n for r in range(self.split.size)])
        self.tr.lap("pipeline idle", t, "wait F" if direction == FWD else "wait B", (mb, g_dst))
        return from_bf16_bits(self.xp, buf) if self.wire_bits else buf

    # --- point-to-point, named after the direction data flows in the model ----------------------
    def recv_forward(self, mb, g, shape):
        """The activations of micro-batch mb into global chunk g, from the chunk before it."""
        return self._recv(mb, g - 1, g, FWD, shape)

    def recv_backward(self, mb, g, shape):
        """The gradient of chunk g's output for micro-batch mb, from the chunk after it."""
        return self._recv(mb, g + 1, g, BWD, shape)

    def send_forward(self, out, mb, g):
        return self._send(out, mb, g + 1, FWD)

    def send_backward(self, din, mb, g):
        return self._send(din, mb, g - 1, BWD)

    def _send(self, arr, mb, g_dst, direction):
        dest = self.place.stage_of(g_dst)
        if dest == self.stage:
            self.local[mb, g_dst, direction] = arr
            return None
        if self.wire_bits:
            arr = to_bf16_bits(self.xp, arr)
            self.in_flight.append(arr)          # alive until the sends are drained
        return self.pp.isend(self._piece(arr), dest=dest, tag=self._tag(mb, g_dst, direction),
                             channel=(g_dst, direction))

    def reads_rows(self) -> bool:
        """Whether this stage computes on rows: it holds the first chunk (tokens) or the last (targets). The
        stages in between never read them: their inputs arrive from the stage before."""
        return self.stage in (self.place.stage_of(0), self.place.stage_of(self.V - 1))

    def run(self, chunks, forward, backward, begin_pass, batch, last_pass: bool, grad: bool = True,
            tracer=OFF, weight=None) -> float:
        """Forward (and backward) of every micro-batch of a data.Batch through `chunks` (this rank's, local
        index c, computing virtual stage Placement.virtual(stage, c)); returns the loss share (last stage).
        The wire shape is the batch's shape, which a stage that reads no rows holds too (Batch.empty)."""
        m, V = self.m, self.V
        rows = batch.rows // m
        act_shape = (rows, batch.seq_len // self.seq_parts, self.width)
        actions = self.actions if grad else self._forward_only()
        caches, sends, losses, live, work = {}, [], [], 0, {}
        self.tr = tr = tracer if grad else OFF     # evaluation is one span in train.py
        t_start, busy_before = time.perf_counter(), self.busy_s
        for a in actions:
            g, chunk, mb = self._g(a.chunk), chunks[a.chunk], a.mb
            if a.kind == "F":
                part = batch.row_slice(mb * rows, (mb + 1) * rows)
                inp = part.tokens if g == 0 else self.recv_forward(mb, g, act_shape)
                t0, t = time.perf_counter(), tr.now()
                out, cache = forward(chunk, inp, part, grad)
                tr.lap("forward", t, "F", (mb, g))
                self.busy_s += time.perf_counter() - t0
                if grad:
                    caches[(mb, a.chunk)] = cache
                    live += 1
                    self.peak_live = max(self.peak_live, live)
                if g == V - 1:
                    losses.append(out)      # read once every action is queued: a device is not drained mid-step
                else:
                    sends.append(self.send_forward(out, mb, g))
            elif a.kind == "B":
                begin_pass(last_pass and mb == m - 1)   # the last backward of a chunk finishes its grads
                dout = None if g == V - 1 else self.recv_backward(mb, g, act_shape)
                t0, t = time.perf_counter(), tr.now()
                defer = [] if self.split_bw else None
                din = backward(chunk, dout, caches.pop((mb, a.chunk)), defer)
                tr.lap("backward", t, "B", (mb, g))
                self.busy_s += time.perf_counter() - t0
                live -= 1
                if defer is not None:
                    work[mb, a.chunk] = defer
                if g > 0:
                    sends.append(self.send_backward(din, mb, g))
            else:
                begin_pass(last_pass and mb == m - 1)   # ... or, split, its last W
                t0, t = time.perf_counter(), tr.now()
                weight(chunk, work.pop((mb, a.chunk)))
                tr.lap("weights", t, "W", (mb, g))
                self.busy_s += time.perf_counter() - t0
            sends = [r for r in sends if r is not None]
            if testall(sends):
                self.in_flight = []
        if sends:
            t = tr.now()
            waitall(sends)
            tr.lap("pipeline idle", t, "drain sends")
        self.in_flight = []
        t_end = time.perf_counter()
        self.wall_s += t_end - t_start
        self.last_run = (t_start, t_end, self.busy_s - busy_before)
        loss = 0.0
        for out in losses:                  # in micro-batch order, as the host adds them
            loss += float(out)
        return loss

    def _forward_only(self):
        return [Action("F", mb, c) for mb in range(self.m) for c in range(self.v)]
