"""Same-shaped matrices in one call: a function of (count, rows, cols) stacks run once per shape on the stacks
concatenated, so that on CuPy every matrix product of the call is one strided-batched cuBLAS GEMM (Muon's
Newton-Schulz iteration over a block's many matrices of one shape, routed experts' stacks among them)."""
from __future__ import annotations


def by_shape(xp, stacks: list, fn) -> list:
    """fn (a (count, rows, cols) stack -> a result of its shape, matrix by matrix) of each of `stacks`, computed
    on the stacks of one (rows, cols) concatenated in their order; the results in the order of `stacks` (views
    of the group's result). All stacks share one dtype."""
    groups: dict = {}
    for i, s in enumerate(stacks):
        groups.setdefault(tuple(s.shape[1:]), []).append(i)
    out = [None] * len(stacks)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = fn(stacks[idx[0]])
            continue
        res = fn(xp.concatenate([stacks[i] for i in idx], axis=0))
        at = 0
        for i in idx:
            n = stacks[i].shape[0]
            out[i] = res[at:at + n]
            at += n
    return out
