"""Activation-cache accounting: what a block's forward keeps for its backward (nested tuples of arrays, or
a recomputed block's input), walked and counted in bytes the same way by the engine and the planner's
calibration.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Recompute:
    """The cache of a recomputed block: just its input."""
    x: object


def cache_arrays(obj):
    """The arrays inside a nested cache (tuples, lists, a Recompute's input), in order."""
    if isinstance(obj, (tuple, list)):
        for o in obj:
            yield from cache_arrays(o)
    elif isinstance(obj, Recompute):
        yield from cache_arrays(obj.x)
    elif hasattr(obj, "nbytes") and hasattr(obj, "base"):
        yield obj


def cache_nbytes(obj, skip_roots: set, seen=None) -> int:
    """Bytes of the distinct arrays inside a nested cache, skipping views of parameter storage."""
    seen = set() if seen is None else seen
    total = 0
    for a in cache_arrays(obj):
        root = a
        while getattr(root, "base", None) is not None:
            root = root.base
        if id(root) not in skip_roots and id(root) not in seen:
            seen.add(id(root))
            total += int(root.nbytes)
    return total
