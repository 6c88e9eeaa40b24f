"""Optimizer: AdamW on any Range of the flat buffers (adamw.py), learning-rate schedules (schedule.py),
global-norm clipping (clip.py). Exports: AdamW, decay_mask, clip_coefficient, sum_of_squares, lr_at."""
from hpengine.optim.adamw import AdamW, decay_mask
from hpengine.optim.clip import clip_coefficient, sum_of_squares
from hpengine.optim.schedule import lr_at

__all__ = ["AdamW", "decay_mask", "clip_coefficient", "sum_of_squares", "lr_at"]
