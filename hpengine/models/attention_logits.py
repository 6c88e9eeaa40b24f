"""What a training step tells of a model's attention for MuonClip: each layer's per-head largest logit over the
step's forwards (every micro-batch and pass), collected through the context's `logits` part, and where each head's
query and key weights sit in the layer's tensors (QKColumns, which the model declares: models/gpt.py, llama.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from hpengine.models.context import LocalLogits


@dataclass(frozen=True)
class QKColumns:
    """Where the query (role "q") or key ("k") weights of each of this rank's heads sit in one tensor of a layer:
    head j's are the last-axis columns start + j stride .. + width (the weight's output columns, and a bias's)."""
    tensor: str
    role: str
    start: int
    stride: int
    width: int

    def columns(self, head: int) -> slice:
        a = self.start + head * self.stride
        return slice(a, a + self.width)


class AttentionLogits(LocalLogits):
    """The largest logit of every (layer, query head) this rank's forwards saw since reset(), kept on the device
    (read once a step); table() gives them by global head (this tp rank holds heads first .. first + local)."""

    def __init__(self, xp, n_layers: int, heads: int, tp_rank: int = 0, tp_size: int = 1):
        self.xp, self.shape = xp, (n_layers, heads)
        self.local = heads // tp_size
        self.first = tp_rank * self.local
        self.reset()

    def reset(self) -> None:
        self.seen = {}

    def sink(self, layer: int):
        return functools.partial(self.record, layer)

    def record(self, layer: int, maxima) -> None:
        prev = self.seen.get(layer)
        self.seen[layer] = maxima if prev is None else self.xp.maximum(prev, maxima)

    def table(self, to_host) -> np.ndarray:
        """(n_layers, heads) float64: the maxima this rank saw at their global head, -inf where it saw none (a
        layer of another pipeline stage, another tp rank's heads), ready for a max over every rank."""
        out = np.full(self.shape, -np.inf)
        for layer, m in self.seen.items():
            out[layer, self.first:self.first + self.local] = to_host(m)
        return out
