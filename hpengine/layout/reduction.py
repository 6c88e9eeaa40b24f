"""Reduction groups as data: for every tensor of a stage, over which communicators its gradient is summed
and whether this rank counts it in the global norm. Gradient sync, the tied-copy sum, sequence parallelism's
replicated tensors and the global norm all read this one description (engine/engine.py).
"""
from __future__ import annotations

from dataclasses import dataclass

REPLICAS = ("dp", "sharding")


@dataclass(frozen=True)
class Reduction:
    """How one tensor's gradient is made whole (sums in this order) and where it counts in the norm."""
    tensor: str
    block: str                 # the block whose gradient view holds it
    sum_over: tuple            # communicator names
    copy: bool                 # this rank's is a copy of another stage's tensor
    counted: bool              # whether this rank adds it to the global norm


# The rules, from where copies of a tensor live:
# - every tensor: summed over the replicas the gradient-sync strategy owns ("dp", "sharding"), and under context
#   parallelism over "cp" too (each cp rank saw its part of every sequence; the sync sums over dp x cp);
# - a tensor another pipeline stage also holds (a tied head's wte): first summed with that copy ("tied");
#   counted once, on the stage that declares it;
# - a tensor every tp rank holds whole (tp_dim None): counted on tp rank 0 only; under sequence parallelism
#   each tp rank saw only its positions, so its gradient is also summed over "tp";
# - a whole tensor applied to each head separately (ParamSpec.tp_partial: the q/k norms) saw only this tp
#   rank's heads, with or without sequence parallelism: summed over "tp" (once, also under sequence parallelism,
#   where its heads' rows are every position).
def reductions(stage, tp_rank: int, sequence_parallel: bool, context_parallel: bool = False) -> tuple[Reduction, ...]:
    """The Reduction of every tensor of `stage` (layout/stage.Stage), in layout order."""
    tied_in = {t: b for b, t in stage.tied.items()}
    replicas = REPLICAS + (("cp",) if context_parallel else ())
    out = []
    for b in stage.blocks:
        for sp in stage.block_specs[b]:
            whole, copy = sp.tp_dim is None, sp.name in stage.copies
            partial = whole and (sequence_parallel or sp.tp_partial)
            over = (("tied",) if sp.name in tied_in else ()) + replicas + (("tp",) if partial else ())
            out.append(Reduction(sp.name, tied_in.get(sp.name, b), over, copy, not copy and not (whole and tp_rank > 0)))
    return tuple(out)


def tied_sums(reds, stage) -> list[Reduction]:
    """The tensors summed with another stage's copy, in the stage's tied order (the same on both ends)."""
    by_name = {r.tensor: r for r in reds}
    return [by_name[t] for t in stage.tied.values()]


def norm_excluded(reds) -> list[str]:
    """Tensors this rank leaves out of the global norm: copies (by name), then the tp replicas in layout
    order; the engine subtracts their squares in this order."""
    copies = sorted(r.tensor for r in reds if r.copy)
    return copies + [r.tensor for r in reds if not r.counted and not r.copy]


def summed_over(reds, axis: str) -> list[str]:
    """Tensors whose gradient is summed over `axis` beyond the replicas, in layout order."""
    return [r.tensor for r in reds if axis in r.sum_over]
