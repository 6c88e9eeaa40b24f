"""What a training step tells of a model's MoE layers (models/moe_mlp.py): the aux and z losses, the selections
per expert of every layer and, under a capacity, the assignments dropped, summed over the step's micro-batches
here and over every rank by riding on the loss allreduce, then turned into the metrics (each layer's
most-loaded expert over the mean; the dropped share) and the global loads the router biases follow.
"""
from __future__ import annotations

import numpy as np


class MoEFigures:
    """The MoE figures of the current step: model 0's aux, z and drops, and the loads of the first `models`
    models (every model's when the router biases need them); empty (no values, no metrics) for a dense model."""

    def __init__(self, model, xp, models: int = 1):
        moe = model.moe
        self.xp = xp
        self.layers = [i for i in range(model.n_layers) if moe is not None and moe.routed(i)]
        self.models = models if moe is not None and moe.cfg.bias_update_rate > 0 else 1
        self.dropping = moe is not None and moe.capacity > 0
        self.shape = (self.models, model.n_layers, moe.E if moe is not None else 0)
        self.reset()

    def reset(self) -> None:
        self.aux = self.z = 0.0
        self.load = self.xp.zeros(self.shape, dtype=np.int64)   # on the device: read once a step
        self.dropped = self.xp.zeros(self.shape[1], dtype=np.int64)

    def add(self, layer: int, stats, model: int = 0) -> None:
        """One MoE layer's forward (models/moe_mlp.MoEStats) of model `model`."""
        if model < self.models:
            self.load[model, layer] += stats.load
        if model == 0:
            self.aux += stats.aux
            self.z += stats.z
            self.dropped[layer] += stats.dropped

    def values(self, to_host) -> list:
        """This rank's share, to be summed over every rank: aux, z, the selections per (model, layer, expert) and,
        under a capacity, the drops per layer (each layer's on the stage that holds it, zeros elsewhere); [] for a
        dense model."""
        if not self.layers:
            return []
        out = [self.aux, self.z] + [float(c) for c in to_host(self.load).reshape(-1)]
        return out + ([float(c) for c in to_host(self.dropped)] if self.dropping else [])

    def loads(self, summed: list) -> np.ndarray:
        """From values() summed over every rank: the global batch's selections, (models, n_layers, E) float64."""
        return np.array(summed[2:2 + int(np.prod(self.shape))], dtype=np.float64).reshape(self.shape)

    def metrics(self, summed: list) -> dict:
        """From values() summed over every rank: the aux and z losses, each the mean over the MoE layers of the
        global-batch value (no coefficient), each layer's load imbalance and, under a capacity, the share of
        (token, slot) assignments dropped (over every MoE layer and per layer); {} for a dense model."""
        if not summed:
            return {}
        n, load = len(self.layers), self.loads(summed)[0]
        imbalance = [float(load[i].max() / load[i].mean()) for i in self.layers]
        out = {"moe_aux_loss": summed[0] / n, "moe_z_loss": summed[1] / n, "moe_load_imbalance": imbalance,
               "moe_load_max": max(imbalance)}
        if self.dropping:
            dropped = np.array(summed[2 + int(np.prod(self.shape)):])
            per = [float(dropped[i] / load[i].sum()) for i in self.layers]
            out.update(moe_dropped=float(dropped[self.layers].sum() / load[self.layers].sum()),
                       moe_dropped_per_layer=per)
        return out
