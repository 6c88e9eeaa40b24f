"""Muon (momentum orthogonalised by a Newton-Schulz iteration, torch.optim.Muon's semantics) for the 2-D weight
matrices inside the blocks, each routed expert's matrix on its own; AdamW, with plain AdamW's arithmetic, for every
other tensor. Runs over one owned Range of a flat buffer; a matrix split over ranks (tensor parallel) or replicated
(data parallel) is orthogonalised whole by the `whole` exchange the caller hands in. NumPy or CuPy through xp.
"""
from __future__ import annotations

import math

import numpy as np

from hpengine.device.kernels import CHUNK, adamw_coefs, adamw_numpy, chunk_plan
from hpengine.device.precision import write_copy
from hpengine.optim.same_shape import by_shape
from hpengine.params.buffers import Range

NS_EPS = 1e-7            # torch.optim.Muon's floor on the Frobenius norm the iteration divides by
LR_ADJUST = ("match_rms_adamw", "original", "none")


def is_muon_matrix(spec) -> bool:
    """Whether Muon updates this tensor: a weight matrix (2-D, or a stack of routed experts' matrices) of a block
    other than the embedding and the head. The MoE router stays with AdamW: its columns are the experts' score
    directions, whose relative lengths set the routing, and orthogonalising would make them all equal."""
    block = spec.block.rsplit(".", 1)[-1] if spec.block else ""
    if block in ("embed", "head") or spec.name.endswith("router.w"):
        return False
    return len(spec.global_shape) == 2 or (len(spec.global_shape) == 3 and spec.ep_dim == 0)


def ns_work(shape) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a whole tensor of `shape` ((in, out), or a stack
    (count, in, out)): m n min(m, n) per matrix, which is how its owners are balanced."""
    *count, m, n = shape
    return math.prod(count) * m * n * min(m, n)


def newton_schulz(xp, g, coefficients, steps: int, eps: float = NS_EPS):
    """The zeroth power (orthogonalisation) of each matrix of g (..., rows, cols) by `steps` iterations of
    X <- a X + (b A + c A^2) X, A = X X^T, run on the wide orientation after dividing each matrix by its Frobenius
    norm (floored at eps); in g's dtype (torch casts to bfloat16 first). Returns a new array shaped as g."""
    a, b, c = coefficients
    tall = g.shape[-2] > g.shape[-1]
    x = xp.swapaxes(g, -1, -2) if tall else g
    x = x / xp.maximum(xp.sqrt((x * x).sum(axis=(-2, -1), keepdims=True)), eps)
    for _ in range(steps):
        gram = x @ xp.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return xp.swapaxes(x, -1, -2) if tall else x


def adjusted_lr(lr: float, rule: str, out_dim: int, in_dim: int) -> float:
    """torch's adjust_lr_fn for an A x B = out x in weight: "original" lr sqrt(max(1, A/B)), "match_rms_adamw"
    lr 0.2 sqrt(max(A, B)), "none" lr."""
    if rule == "original":
        return lr * math.sqrt(max(1.0, out_dim / in_dim))
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(out_dim, in_dim))
    if rule == "none":
        return lr
    raise ValueError(f"optim.muon_lr_adjust = {rule!r}: valid values are {', '.join(map(repr, LR_ADJUST))}")


def _lerp_(xp, start, end, weight: float):
    """start <- start + weight (end - start), in torch's two-sided form (exact at weight 0 and 1)."""
    if weight < 0.5:
        start += weight * (end - start)
    else:
        start[...] = end - (end - start) * (1.0 - weight)


class Muon:
    """State for the elements of one owned range: `muon_m` spans the range, the momentum buffer on Muon matrices and
    Adam's first moment elsewhere; `muon_v`, Adam's second moment, covers only the tensors AdamW updates, in the
    range's order (one value per Muon matrix element, two per AdamW element)."""
    STATE = ("muon_m", "muon_v")

    def __init__(self, xp, layout, r: Range, dtype, o, whole=None):
        self.xp, self.range, self.t = xp, r, 0
        self.m = xp.zeros(r.size, dtype=dtype)
        self.b1, self.b2 = tuple(o.betas)
        self.eps, self.wd = o.eps, o.weight_decay
        self.momentum, self.nesterov = o.muon_momentum, o.muon_nesterov
        self.coefs, self.steps = tuple(o.muon_ns_coefficients), o.muon_ns_steps
        self.rule = o.muon_lr_adjust
        adjusted_lr(1.0, self.rule, 1, 1)          # refuses an unknown rule here, not at the first step
        self.whole = whole
        self.matrices = []      # (start, stop relative to r, name, local (count, in, out), whole (in, out), decay)
        adam = []               # [start, stop) relative to r, of elements AdamW updates, with their decay runs
        for name, part, off in layout.tensors_in(r):
            if part != layout.ranges[name]:
                raise ValueError(f"muon: tensor {name!r} is cut by the owned range [{r.start}, {r.stop}); Muon "
                                 "needs whole matrices (sharding.partition = 'tensor')")
            spec, shape = layout.by_name[name], layout.shapes[name]
            a, b = part.start - r.start, part.stop - r.start
            if is_muon_matrix(spec):
                if spec.true_shape is not None:      # padding would enter the orthogonalisation
                    raise ValueError(f"muon: matrix {name!r} is padded to {spec.global_shape}; Muon needs it unpadded")
                self.matrices.append((a, b, name, (1, *shape) if len(shape) == 2 else tuple(shape),
                                      tuple(spec.global_shape[-2:]), spec.decay))
            elif adam and adam[-1][1] == a and adam[-1][2] == spec.decay:
                adam[-1][1] = b
            else:
                adam.append([a, b, spec.decay])
        chunk = min(CHUNK, r.size) if xp is np else r.size
        # each AdamW run in the kernel twin's chunks, with its decay runs, as plain AdamW plans the whole range, and
        # where its second moment starts in v
        self.adam, at = [], 0
        for a, b, d in adam:
            self.adam.append((a, b, at, chunk_plan(b - a, max(chunk, 1), [(0, b - a)] if d else [])))
            at += b - a
        self.v = xp.zeros(at, dtype=dtype)
        self._v_at = {}         # start of each AdamW tensor (relative to r) -> where its second moment starts in v
        for name, part, _ in layout.tensors_in(r):
            a = part.start - r.start
            run = next((x for x in self.adam if x[0] <= a < x[1]), None)
            if run is not None:
                self._v_at[a] = run[2] + a - run[0]
        self._scratch = (xp.empty(max(chunk, 1), dtype=dtype), xp.empty(max(chunk, 1), dtype=dtype))

    def nbytes(self) -> int:
        return self.m.nbytes + self.v.nbytes

    def state(self) -> dict:
        return dict(zip(self.STATE, (self.m, self.v)))

    def state_at(self, a: int) -> dict:
        return {"muon_m": a, "muon_v": self._v_at[a]} if a in self._v_at else {"muon_m": a}

    def step(self, p, g, lr: float, grad_coef: float = 1.0, copy=None) -> None:
        """Update p (this range of the parameters, in place) from g x grad_coef; copy, when given, receives the
        updated weights (amp's compute copy)."""
        self.t += 1
        xp = self.xp
        c = adamw_coefs(self.t, lr, (self.b1, self.b2), self.eps, self.wd, grad_coef)
        for a, b, v, plan in self.adam:
            adamw_numpy(p[a:b], g[a:b], self.m[a:b], self.v[v:v + b - a], None, c, None if copy is None else copy[a:b],
                        plan=plan, scratch=self._scratch)
        upds = []
        for a, b, _, shape, _, _ in self.matrices:
            grad = g[a:b] if grad_coef == 1.0 else g[a:b] * grad_coef
            buf = self.m[a:b]
            _lerp_(xp, buf, grad, 1.0 - self.momentum)
            if self.nesterov:
                upd = grad.copy()
                _lerp_(xp, upd, buf, self.momentum)
            else:
                upd = buf
            upds.append(upd.reshape(shape))
        if self.whole is None and xp.__name__ == "cupy":    # one batched iteration per shape (cuBLAS)
            orthos = by_shape(xp, upds, self._orthogonalise)
        elif self.whole is None:                            # NumPy loops over a stack anyway: one by one
            orthos = [self._orthogonalise(u) for u in upds]
        else:       # each matrix whole on one rank, this rank's part of every result back
            orthos = self.whole.apply([m[2] for m in self.matrices], upds, self._orthogonalise, self.range,
                                      self.m.dtype)
        for (a, b, _, _, (fan_in, fan_out), decay), ortho in zip(self.matrices, orthos):
            w = p[a:b]
            if decay:
                w *= 1.0 - lr * self.wd          # torch decays with the unadjusted lr
            w -= adjusted_lr(lr, self.rule, fan_out, fan_in) * ortho.reshape(-1)
            if copy is not None:
                write_copy(xp, copy[a:b], w)

    def _orthogonalise(self, upd):
        """The orthogonalised update of whole matrices upd (count, in, out).
        hpengine stores x @ W weights as (in, out); torch's (out, in) weight is the transpose, on which the
        iteration commutes with transposition and the lr rule reads A = out, B = in (of the whole matrix)."""
        xp = self.xp
        return xp.swapaxes(newton_schulz(xp, xp.swapaxes(upd, -1, -2), self.coefs, self.steps), -1, -2)
