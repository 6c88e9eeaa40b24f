"""What a training step tells of a model's MoE layers (models/moe_mlp.py): the aux and z losses and the
selections per expert of every layer, summed over the step's micro-batches here and over every rank by
riding on the loss allreduce, then turned into the metrics (each layer's most-loaded expert over the mean).
"""
from __future__ import annotations

import numpy as np


class MoEFigures:
    """One model's MoE figures for the current step; empty (no values, no metrics) for a dense model."""

    def __init__(self, model, xp):
        moe = getattr(model, "moe", None)
        self.xp = xp
        self.layers = [i for i in range(model.n_layers) if moe is not None and moe.routed(i)]
        self.shape = (model.n_layers, moe.E if moe is not None else 0)
        self.reset()

    def reset(self) -> None:
        self.aux = self.z = 0.0
        self.load = self.xp.zeros(self.shape, dtype=np.int64)   # on the device: read once a step

    def add(self, layer: int, stats) -> None:
        """One MoE layer's forward (models/moe_mlp.MoEStats)."""
        self.aux += stats.aux
        self.z += stats.z
        self.load[layer] += stats.load

    def values(self, to_host) -> list:
        """This rank's share, to be summed over every rank: aux, z and the selections per (layer, expert) (each
        layer's on the stage that holds it, zeros elsewhere); [] for a dense model."""
        if not self.layers:
            return []
        return [self.aux, self.z] + [float(c) for c in to_host(self.load).reshape(-1)]

    def metrics(self, summed: list) -> dict:
        """From values() summed over every rank: the aux and z losses, each the mean over the MoE layers of the
        global-batch value (no coefficient), and each layer's load imbalance; {} for a dense model."""
        if not summed:
            return {}
        n, load = len(self.layers), np.array(summed[2:]).reshape(self.shape)
        imbalance = [float(load[i].max() / load[i].mean()) for i in self.layers]
        return {"moe_aux_loss": summed[0] / n, "moe_z_loss": summed[1] / n, "moe_load_imbalance": imbalance,
                "moe_load_max": max(imbalance)}
