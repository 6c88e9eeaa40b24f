"""DiLoCo's outer loop on this rank's owned part of the parameters: every inner_steps steps (per fragment, staggered
under streaming) the pseudo-gradient (outer - island) is averaged over the islands (allreduce, or the quantised
exchange of diloco_exchange.py), the outer parameters take an SGD step with (Nesterov) momentum and the island
restarts from them (overlap: the exchange lands H / F steps later, mixed in).
"""
from __future__ import annotations

from bisect import bisect_right
from math import prod

from mpi4py import MPI

from hpengine.dist.comm import testall, waitall
from hpengine.device.precision import write_copy
from hpengine.params.blocks import fragment_plan, tensor_blocks
from hpengine.params.buffers import cut, partition
from hpengine.strategies.diloco_exchange import QuantisedExchange
from hpengine.strategies.quantize import BLOCK, Wire

STATE = ("outer_param", "outer_momentum", "outer_residual")     # the checkpoint's names


class Outer:
    """The outer state over this rank's owned part (n elements, in the dtype of what the optimizer updates)."""

    def __init__(self, dl, comm, xp, p0, fragments: list[list[tuple[int, int]]], plans=None, maxed=None):
        """dl: the [strategy.diloco] table; comm: the replica Comm; p0: the owned values the run starts from;
        fragments: per fragment, the (start, stop) slices of the owned array it holds here; plans: per fragment, how
        they meet the blocks of whole tensors (params/blocks.py Plan; int8/int4 only); maxed: the MAX over the
        island's ranks that share blocks, in place (None: each rank holds whole tensors)."""
        self.dl, self.comm, self.xp = dl, comm, xp
        self.H, self.M = dl.inner_steps, comm.size
        self.fragments, self.maxed = fragments, maxed
        self.plans = plans
        self.param = p0.copy()
        self.momentum = xp.zeros_like(p0) if dl.outer_momentum > 0 else None
        self.residual = xp.zeros_like(p0) if dl.quantize != "none" else None
        # overlap: an exchange started after step s lands after step s + tau; `pending` holds the landed means
        # of exchanges settled early (for a checkpoint), `flight` the ones on the wire: fragment -> (step, req, buf)
        self.tau = self.H // len(fragments) if dl.overlap else 0
        self.pending = xp.zeros_like(p0) if dl.overlap else None
        self.flight, self.settled = {}, {}
        if self.tau:
            comm.on_close.append(self.settle)      # no exchange left on the wire when the mesh is freed
        self.steps = 0          # outer exchanges done (one per fragment synchronised)

    def due(self, step: int) -> list[int]:
        """The fragments synchronised after optimizer step `step` (0-based): fragment f when step + 1 + f H / F is
        a multiple of H (all of them every H steps when F = 1)."""
        F = len(self.fragments)
        return [f for f in range(F) if (step + 1 + f * self.H // F) % self.H == 0]

    def state(self) -> dict:
        return {k: a for k, a in zip(STATE, (self.param, self.momentum, self.residual)) if a is not None}

    def reset(self, p) -> None:
        """The outer parameters from the island's (a checkpoint without outer state: a fresh outer loop)."""
        self.param[...] = p
        self.flight, self.settled = {}, {}
        for a in (self.momentum, self.residual, self.pending):
            if a is not None:
                a[...] = 0

    def advance(self, step: int, p, copy) -> list[tuple]:
        """The outer work after optimizer step `step`: without overlap each due fragment's exchange and step; with
        it, first the exchanges started tau steps ago land, then the due fragments' start. Returns per event
        (this island's drift or None, the averaged pseudo-gradient or None), over the whole owned array."""
        if not self.tau:
            return [(self.start(f, p, step), self.land(f, p, copy)) for f in self.due(step)]
        testall([r for _, r, _ in self.flight.values() if r is not None])     # MPI progresses them only in calls
        for f in sorted(self.flight):
            at, _, ex = self.flight[f]
            if self.dl.quantize != "none":      # phase 2 halfway: a fixed step, so every rank starts it in order
                ex.poll()
                if at + (self.tau + 1) // 2 == step:
                    ex.reduce()
        landing = [f for f, (at, *_) in self.flight.items() if at + self.tau == step]
        landing += [f for f, at in self.settled.items() if at + self.tau == step]
        out = [(None, self.land(f, p, copy)) for f in sorted(landing)]
        return out + [(self.start(f, p, step), None) for f in self.due(step)]

    def start(self, f: int, p, step: int):
        """Fragment f's pseudo-gradient put on the wire (blocking without overlap); returns the drift."""
        xp, dl, idx = self.xp, self.dl, self._index(f)
        drift = xp.zeros_like(p)
        delta = self._take(self.param, idx) - self._take(p, idx)
        self._put(drift, idx, delta)
        if dl.quantize == "none":
            if self.tau:
                self.flight[f] = (step, self.comm.iallreduce_(delta), delta)
            else:
                self.flight[f] = (step, None, self.comm.allreduce_(delta))
            return drift
        v = delta + self._take(self.residual, idx)
        wire = Wire(self.plans[f], self.M, dl.quantize)     # its index arrays live as long as the exchange
        ex = QuantisedExchange(self.comm, xp, wire, v.dtype, bool(self.tau), self.maxed)
        self._put(self.residual, idx, v - ex.start(v))
        self.flight[f] = (step, None, ex)
        return drift

    def _mean(self, f: int):
        """Fragment f's mean pseudo-gradient, its exchange completed."""
        if f in self.settled:
            del self.settled[f]
            return self._take(self.pending, self._index(f))
        _, req, buf = self.flight.pop(f)
        if self.dl.quantize != "none":
            return buf.mean()
        waitall([req])
        return buf / buf.dtype.type(self.M)

    def settle(self) -> None:
        """Every exchange on the wire completed into `pending` (before a checkpoint saves it)."""
        for f in sorted(self.flight):
            at = self.flight[f][0]
            self._put(self.pending, self._index(f), self._mean(f))
            self.settled[f] = at

    def resume(self, steps: int | None) -> None:
        """After a checkpoint of `steps` optimizer steps: the exchanges started in the last tau steps are the
        settled ones its `pending` holds (None: a checkpoint without them; the next due exchanges start afresh)."""
        self.flight = {}
        self.settled = {}
        if self.tau and steps is not None:
            self.settled = {f: t for t in range(max(0, steps - self.tau), steps) for f in self.due(t)}

    def land(self, f: int, p, copy):
        """Fragment f's outer step from its exchange's mean; the island's values restart from the new outer
        parameters, or under overlap take mix x theirs + (1 - mix) x the new outer ones (Streaming DiLoCo's
        merge). Returns the averaged pseudo-gradient over the whole owned array (zero outside the fragment)."""
        xp, dl, idx = self.xp, self.dl, self._index(f)
        mean = self._mean(f)
        avg = xp.zeros_like(p)
        self._put(avg, idx, mean)
        upd = mean
        if self.momentum is not None:     # PyTorch SGD: buf = mu buf + g; Nesterov: g + mu buf, else buf
            mu = p.dtype.type(dl.outer_momentum)
            buf = self._take(self.momentum, idx) * mu + mean
            self._put(self.momentum, idx, buf)
            upd = mean + mu * buf if dl.nesterov else buf
        new = self._take(self.param, idx) - p.dtype.type(dl.outer_lr) * upd
        self._put(self.param, idx, new)
        if self.tau:
            a = p.dtype.type(dl.overlap_mix)
            new = a * self._take(p, idx) + (p.dtype.type(1) - a) * new
        self._put(p, idx, new)
        if copy is not None:
            for a, b in idx:
                write_copy(xp, copy[a:b], p[a:b])
        self.steps += 1
        return avg

    def _index(self, f: int) -> list[tuple[int, int]]:
        return self.fragments[f]

    def _take(self, a, idx):
        if len(idx) == 1:
            return a[idx[0][0]:idx[0][1]].copy()
        return self.xp.concatenate([a[s:e] for s, e in idx]) if idx else a[:0].copy()

    @staticmethod
    def _put(a, idx, v) -> None:
        at = 0
        for s, e in idx:
            a[s:e] = v[at:at + e - s]
            at += e - s


def fragment_of(specs, fragments: int) -> dict[str, int]:
    """The fragment of every tensor (specs: the whole model's, every stage's, in one-process layout order): F
    contiguous groups of whole tensors minimising the largest group's global (unpadded) element count, as the
    sharding partition by tensors cuts; the same for every layout. layout.resolve refuses F above the tensor count."""
    sizes = [prod(sp.true_shape or sp.global_shape) for sp in specs]
    starts = [r.start for r in partition(sizes, fragments, "tensor")]
    out, at = {}, 0
    for sp, n in zip(specs, sizes):
        out[sp.name] = bisect_right(starts, at) - 1
        at += n
    return out


def fragment_slices(parts, layout, of: dict[str, int], fragments: int) -> list[list[tuple[int, int]]]:
    """Per fragment, the (start, stop) slices of the owned array (parts: (flat Range, offset) pieces of the stage's
    buffer) that hold its tensors (of: tensor name -> fragment, a stage's copy of another stage's tensor going
    with it): one slice per tensor piece, in owned order (what tp or sharding leaves of the tensor here)."""
    out = [[] for _ in range(fragments)]
    for name in layout.names:
        out[of[name]] += [(at, at + r.size) for r, at in cut(parts, layout.ranges[name])]
    return [sorted(pieces) for pieces in out]


def fragment_plans(parts, layout, of: dict[str, int], fragments: int):
    """Per fragment, how the pieces fragment_slices gives (in its order) meet the quantisation blocks of whole
    tensors: the fragment's tensors here numbered one after another in layout order, the same on every rank of the
    island that holds this stage, whatever its tp slice or sharding share (params/blocks.py Plan)."""
    base, pieces = [0] * fragments, [[] for _ in range(fragments)]
    for name in layout.names:
        f, spec, r0 = of[name], layout.by_name[name], layout.ranges[name].start
        for r, at in cut(parts, layout.ranges[name]):
            pieces[f].append((at, spec, layout.box(name), r.start - r0, r.stop - r0, base[f]))
        base[f] += tensor_blocks(spec, BLOCK)
    return [fragment_plan([p[1:] for p in sorted(ps, key=lambda p: p[0])], base[f], BLOCK)
            for f, ps in enumerate(pieces)]


def block_max(comms):
    """The in-place MAX of a vector over these communicators one after another (the island's ranks that hold parts
    of the same tensors: its tp group, and its sharding group where the partition cuts tensors), skipping those of
    one rank; None when none is left (every rank holds whole tensors: no collective)."""
    comms = [c for c in comms if c is not None and c.size > 1]
    if not comms:
        return None

    def maxed(a):
        for c in comms:
            c.allreduce_(a, op=MPI.MAX)
    return maxed
