"""Optimizers behind one seam (base.py: what the engine, checkpoint and planner know of an optimizer; AdamW,
adamw.py; Muon with AdamW for the non-matrix tensors, muon.py, and its QK-Clip, qk_clip.py), learning-rate
schedules (schedule.py), global-norm clipping (clip.py).
Exports: Optimizer, OptimizerKind, optimizer_kind, make_optimizer, AdamW, decay_mask, clip_coefficient, ..."""
from hpengine.optim.adamw import AdamW, decay_mask
from hpengine.optim.base import Optimizer, OptimizerKind, kind as optimizer_kind, make as make_optimizer, post_update
from hpengine.optim.clip import clip_coefficient, sum_of_squares
from hpengine.optim.schedule import lr_at

__all__ = ["AdamW", "decay_mask", "Optimizer", "OptimizerKind", "optimizer_kind", "make_optimizer",
           "clip_coefficient", "sum_of_squares", "lr_at", "post_update"]
