"""What a pipeline schedule is made of: actions (forward, backward, weight gradient of one micro-batch through
one model chunk), where each stage's chunks sit in the model (Placement), and the checks every schedule
makes of its sizes. schedules.py and zero_bubble.py build lists of these; the executor walks them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work on a stage: forward ("F"), backward ("B"; with no "W" for the same micro-batch
    and chunk it includes the weight gradients) or weight gradients ("W") of micro-batch `mb` through local
    model chunk `chunk` (the virtual stage Placement.virtual gives; always 0 with one chunk per stage)."""
    kind: str
    mb: int
    chunk: int = 0

    def __str__(self):
        return f"{self.kind}{self.mb}" + (f".c{self.chunk}" if self.chunk else "")


def check_args(p, m, stage):
    """Refuse a pipeline size, micro-batch count or stage that no schedule can take (one line each)."""
    if p < 1:
        raise ValueError(f"pipeline size p={p} must be >= 1")
    if m < 1:
        raise ValueError(f"number of micro-batches m={m} must be >= 1")
    if not 0 <= stage < p:
        raise ValueError(f"stage={stage} must be in 0..{p - 1} for p={p}")


@dataclass(frozen=True)
class Placement:
    """Which virtual stage local chunk c of stage s computes: c * p + s, as Megatron interleaves, or with
    `vee` odd chunks run back up the pipe (ZB-V: chunk 1 of stage s is virtual stage 2p - 1 - s)."""
    p: int
    v: int = 1
    vee: bool = False

    def virtual(self, stage: int, chunk: int) -> int:
        """The virtual stage that `chunk` of `stage` computes."""
        back = self.vee and chunk % 2
        return chunk * self.p + (self.p - 1 - stage if back else stage)

    def stage_of(self, g: int) -> int:
        """The stage that holds virtual stage `g`."""
        chunk, k = divmod(g, self.p)
        return self.p - 1 - k if self.vee and chunk % 2 else k


