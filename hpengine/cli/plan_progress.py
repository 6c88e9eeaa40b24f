"""`hpengine plan`'s progress on stderr: a tqdm bar of the layouts searched and pruned when stderr is a terminal,
else nothing until one summary line ("searched N layouts (M pruned) in X s") once the search is done.
"""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

from hpengine.planner.prune import SearchProgress


class PlanProgress(SearchProgress):
    """The search's SearchProgress drawn with tqdm; `summary()` is the line a redirected stderr gets instead."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = _isatty(self.stream)
        self.bar, self.searched, self.pruned, self.t0 = None, 0, 0, time.perf_counter()

    def start(self, total: int) -> None:
        self.bar = tqdm(total=total, unit=" layouts", unit_scale=True, desc="hpengine plan", file=self.stream,
                        disable=not self.tty, leave=False, dynamic_ncols=True, mininterval=0.2)

    def update(self, searched: int, pruned: int) -> None:
        self.searched += searched
        self.pruned += pruned
        if self.bar is not None:
            self.bar.update(searched + pruned)
            self.bar.set_postfix_str(f"{self.pruned:,} pruned", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def summary(self) -> str:
        return (f"hpengine plan: searched {self.searched + self.pruned:,} layouts ({self.pruned:,} pruned) in "
                f"{time.perf_counter() - self.t0:.1f} s")


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
