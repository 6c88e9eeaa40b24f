"""Activation-cache accounting: what a block's forward keeps for its backward (nested tuples of arrays, or
a recomputed block's input), walked, rebuilt and counted in bytes the same way by the engine and the
planner's calibration. A leaf is anything with `nbytes` and `base`: an array, or a packed bfloat16 holder
(strategies/bf16_storage.py), which counts through the same two attributes.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Recompute:
    """The cache of a recomputed block: just its input."""
    x: object


class ChunkCaches(list):
    """A chunk's block caches in block order, and the context its forward ran in (the micro-batch's packed
    documents), which its backward and any recomputed forward run in too."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx


def _is_leaf(obj) -> bool:
    return hasattr(obj, "nbytes") and hasattr(obj, "base")


def cache_arrays(obj):
    """The arrays inside a nested cache (tuples, lists, a Recompute's input), in order."""
    if isinstance(obj, (tuple, list)):
        for o in obj:
            yield from cache_arrays(o)
    elif isinstance(obj, Recompute):
        yield from cache_arrays(obj.x)
    elif _is_leaf(obj):
        yield obj


def map_cache(obj, fn):
    """The cache rebuilt with fn(leaf) in place of each array (or packed holder), in cache_arrays' order;
    tuples, lists and Recompute keep their shape and everything else (shapes, None, statistics) is kept."""
    if isinstance(obj, tuple):
        items = [map_cache(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)    # a named tuple keeps its type
    if isinstance(obj, list):
        return [map_cache(o, fn) for o in obj]
    if isinstance(obj, Recompute):
        return Recompute(map_cache(obj.x, fn))
    return fn(obj) if _is_leaf(obj) else obj


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
