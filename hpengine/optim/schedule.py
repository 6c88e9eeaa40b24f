"""Learning-rate schedules: linear warm-up, then cosine / linear decay to min_lr_ratio·lr, or constant.
Owns lr_at, the rate for one optimizer step."""
from __future__ import annotations

import math


def lr_at(step: int, ocfg, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): warm-up steps 0..W-1 run at lr·(step+1)/W, so
    the first step already trains; the decay reaches min_lr_ratio·lr at step = total_steps (one past
    the last step run)."""
    base, warm = ocfg.lr, ocfg.warmup_steps
    if warm and step < warm:
        return base * (step + 1) / warm
    if ocfg.schedule == "constant":
        return base
    floor = base * ocfg.min_lr_ratio
    span = max(1, total_steps - warm)
    frac = min(1.0, (step - warm) / span)
    if ocfg.schedule == "linear":
        return floor + (base - floor) * (1.0 - frac)
    return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
