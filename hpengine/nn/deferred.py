"""Weight-gradient work a split backward leaves for later: a zero-bubble pipeline's W (Qi et al. 2023).
A backward handed a queue (a list) computes its input gradient now and appends one Deferred per weight
product instead of running it; the caller runs the queue later, in order. Handed None it runs each product
at once, in the fused backward's order, so the fused path is the code it always was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Deferred:
    """fn(*args): weight-gradient products accumulating into gradient views. `held` are the arrays only this
    work still needs (its input and output gradients, the caches it reads): what the W stash holds."""
    fn: Callable
    args: tuple
    held: tuple

    def run(self) -> None:
        self.fn(*self.args)


def weight_grad(defer: list | None, fn: Callable, *args, held: tuple = ()) -> None:
    """fn(*args) now (defer is None) or queued on defer. A queued work reads its arrays when it runs: the
    caller leaves them unmodified until then."""
    if defer is None:
        fn(*args)
    else:
        defer.append(Deferred(fn, args, held))


def run_all(works) -> None:
    """Run queued weight-gradient work in the order it was queued."""
    for w in works:
        w.run()
