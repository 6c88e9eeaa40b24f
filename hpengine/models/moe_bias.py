"""Aux-loss-free balancing (DeepSeek-V3): each MoE layer's per-expert router bias, which shifts the top-k
selection only (models/moe_mlp.MoEMLP.set_bias). It is state, not a parameter: no gradient, no optimizer.
A checkpoint keeps them in its manifest, whatever the layout.
"""
from __future__ import annotations

import numpy as np

KEY = "router_bias"     # the manifest's state entry: one (n_layers, E) nested list per model


def saved_bias(state: dict, model: int = 0):
    """Model `model`'s biases, (n_layers, E) float64, from a checkpoint manifest's state; None when it has none."""
    saved = state.get(KEY)
    return None if saved is None else np.array(saved[model], dtype=np.float64)


class RouterBiasError(ValueError):
    """A checkpoint's router biases do not fit the config's models."""


# Every rank holds all of it, (n_layers, E) float64 on the host per model, and after every applied optimizer
# step adds rate * sign(mean load - load) from the global batch's selections (MoEFigures.loads, summed over
# every rank first), so every rank computes the same biases.
class RouterBias:
    """The router biases of the models of one stage (each model object gets its own); inert for dense models."""

    def __init__(self, models, rate: float, xp):
        self.moes = [m.moe for m in models]
        self.rate, self.xp = float(rate), xp
        self.bias = [np.zeros((m.n_layers, moe.E)) for m, moe in zip(models, self.moes) if moe is not None]

    def update(self, loads: np.ndarray) -> None:
        """One optimizer step's update from the global selections, (models, n_layers, E) (MoEFigures.loads)."""
        if self.rate <= 0 or not self.bias:
            return
        for b, load, moe in zip(self.bias, loads, self.moes):
            for i in range(b.shape[0]):
                if moe.routed(i):       # under-loaded experts (below the mean) up, over-loaded ones down
                    b[i] += self.rate * np.sign(load[i].mean() - load[i])
            moe.set_bias(self.xp, b)

    def meta(self) -> dict:
        """What the checkpoint manifest's state gets: {KEY: one nested list per model} (exact: JSON keeps a
        float64's shortest repr), or {} while every bias is zero (a dense model, or no bias update yet)."""
        return {KEY: [b.tolist() for b in self.bias]} if any(b.any() for b in self.bias) else {}

    def load(self, state: dict) -> None:
        """Take the biases of a checkpoint manifest's state (meta()); none there means zeros."""
        if not self.bias:
            return
        saved = state.get(KEY)
        got = [np.zeros_like(b) for b in self.bias] if saved is None else [np.array(b, dtype=np.float64) for b in saved]
        if [g.shape for g in got] != [b.shape for b in self.bias]:
            raise RouterBiasError(f"the checkpoint's router biases have shapes {[g.shape for g in got]}, the config's "
                                  f"models {[b.shape for b in self.bias]} (one (n_layers, num_experts) per model): it "
                                  "holds another model")
        self.bias = got
        for b, moe in zip(self.bias, self.moes):
            moe.set_bias(self.xp, b)
