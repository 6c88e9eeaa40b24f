"""Mixed precision: dynamic loss scaling. Compute runs in float16 or bfloat16; the owner of each range keeps
the float32 master weights and AdamW moments (engine.py). An overflow anywhere makes every rank skip the
same step and lower the scale; `growth_interval` clean steps in a row raise it again. bfloat16 has
float32's exponent range, so it trains without loss scaling by default (amp.loss_scaling = "auto").
"""
from __future__ import annotations


def loss_scaling(acfg) -> bool:
    """Whether dynamic loss scaling runs: "auto" = float16 only."""
    if acfg.loss_scaling == "auto":
        return acfg.dtype == "float16"
    return acfg.loss_scaling == "dynamic"


class LossScaler:
    def __init__(self, acfg):
        self.scale = float(acfg.init_scale)
        self.growth_interval, self.backoff = acfg.growth_interval, acfg.backoff
        self.growth_factor = acfg.growth_factor
        self.good_steps = 0
        self.skipped = 0

    def update(self, finite: bool) -> None:
        """After a step: back off on overflow, grow after growth_interval clean steps."""
        if not finite:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load(self, st: dict) -> None:
        self.scale, self.good_steps, self.skipped = float(st["scale"]), int(st["good_steps"]), int(st["skipped"])
