"""Optimizer: AdamW on any Range of the flat buffers, learning-rate schedules, global-norm clipping."""
from .adamw import AdamW, decay_mask
from .clip import clip_coefficient, sum_of_squares
from .schedule import lr_at

__all__ = ["AdamW", "decay_mask", "clip_coefficient", "sum_of_squares", "lr_at"]
