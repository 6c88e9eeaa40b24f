"""MuonClip's QK-Clip (Kimi K2): after each update, every attention head whose largest logit over the step's
forwards exceeded tau has its query and key weights scaled so that logit becomes tau. The step an optimizer kind
runs after its update (base.post_update); the maxima come from the layers through the context's `logits` part.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hpengine.device.bf16_bits import to_bf16_bits
from hpengine.device.precision import round_bf16_
from hpengine.models.attention_logits import AttentionLogits


def clip_factors(maxima: np.ndarray, tau: float, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(factor per query head, factor per key head) for one layer's largest logits (query heads,): gamma =
    tau / max where max > tau, else 1. One query head per key head: q and k each by sqrt(gamma), so their logit
    scales by gamma. A key head shared by a group: the query heads by gamma and the key untouched, so one head's
    clip does not shrink its group's other heads (Kimi K2 leaves its shared rotary key alone likewise)."""
    gamma = np.where(maxima > tau, tau / np.where(maxima > tau, maxima, 1.0), 1.0)
    if group == 1:
        root = np.sqrt(gamma)
        return root, root
    return gamma, np.ones(len(maxima) // group)


class NoPostUpdate:
    """An optimizer step with nothing after it (and no attention logits to collect)."""

    def context(self, ctx):
        return ctx

    def begin_step(self) -> None:
        pass

    def apply(self, p, copy=None) -> None:
        pass


class QKClip(NoPostUpdate):
    """QK-Clip over one rank's owned range of a flat buffer (a model stage's layout), at threshold tau."""

    def __init__(self, tau: float, model, layout, own, xp, to_host, max_all, tp_rank: int = 0, tp_size: int = 1,
                 prefix: str = ""):
        self.tau, self.layout, self.own, self.xp, self.to_host, self.max_all = tau, layout, own, xp, to_host, max_all
        self.logits = AttentionLogits(xp, model.n_layers, model.cfg.n_heads, tp_rank, tp_size)
        self.layers = []            # (layer, its QKColumns held here, group) for this stage's layers
        for i in range(model.n_layers):
            cols, group = model.qk_columns(i, tp_size)
            cols = [dataclasses.replace(c, tensor=prefix + c.tensor) for c in cols]
            if cols and all(c.tensor in layout.ranges for c in cols):
                self.layers.append((i, cols, group))

    def context(self, ctx):
        """ctx with this clip's collector as its `logits` part: the layers measure while it is there."""
        return dataclasses.replace(ctx, logits=self.logits)

    def begin_step(self) -> None:
        self.logits.reset()

    def apply(self, p, copy=None) -> None:
        """Scale the clipped heads' query and key weights in p (this rank's owned range, updated; the float32
        masters under amp) and in copy (amp's compute copy of it), from the maxima over every rank. Collective:
        every rank calls it, once a step, after its update."""
        table = self.max_all(self.logits.table(self.to_host))
        lg = self.logits
        for i, cols, group in self.layers:
            fq, fk = clip_factors(table[i, lg.first:lg.first + lg.local], self.tau, group)
            for c in cols:
                for head, f in enumerate(fq if c.role == "q" else fk):
                    if f != 1.0:
                        self._scale(p, copy, c, head, float(f))

    def _scale(self, p, copy, c, head: int, f: float) -> None:
        """Head `head`'s columns of tensor c.tensor times f, where they lie in the owned range."""
        r, shape = self.layout.ranges[c.tensor], self.layout.shapes[c.tensor]
        cols = np.arange(shape[-1])[c.columns(head)]
        rows = np.arange(int(np.prod(shape[:-1], dtype=np.int64)))[:, None] * shape[-1]
        idx = (r.start + rows + cols[None, :]).reshape(-1)
        idx = idx[(idx >= self.own.start) & (idx < self.own.stop)] - self.own.start
        if idx.size == 0:
            return
        idx = self.xp.asarray(idx)
        p[idx] *= f
        if copy is not None:        # as the optimizers write amp's compute copy: float16, bf16 values, or their bits
            w = p[idx]
            if copy.dtype == np.uint16:
                copy[idx] = to_bf16_bits(self.xp, w)
            else:
                w = w.astype(copy.dtype)
                if copy.dtype == np.float32:
                    round_bf16_(self.xp, w)
                copy[idx] = w
