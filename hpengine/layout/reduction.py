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
    norm_over: tuple = ()      # communicators its square is summed over beyond the owners' ("ep": other experts)


# The rules, from where copies of a tensor live:
# - every tensor: summed over the replicas the gradient-sync strategy owns ("dp", "sharding"), and under context
#   parallelism over "cp" too (each cp rank saw its part of every sequence; the sync sums over dp x cp);
# - a tensor another pipeline stage also holds (a tied head's wte): first summed with that copy ("tied");
#   counted once, on the stage that declares it;
# - a tensor every tp rank holds whole (tp_dim None): counted on tp rank 0 only; under sequence parallelism
#   each tp rank saw only its positions, so its gradient is also summed over "tp";
# - a whole tensor applied to each head separately (ParamSpec.tp_partial: the q/k norms) saw only this tp
#   rank's heads, with or without sequence parallelism: summed over "tp" (once, also under sequence parallelism,
#   where its heads' rows are every position);
# - an expert tensor split over expert-parallel ranks (ParamSpec.ep_dim): each ep rank holds other experts, so
#   its gradient is summed over that block's replicas only ("ep-dp" in place of "dp"), and its square over "ep"
#   in the global norm.
def reductions(stage, tp_rank: int, sequence_parallel: bool, context_parallel: bool = False) -> tuple[Reduction, ...]:
    """The Reduction of every tensor of `stage` (layout/stage.Stage), in layout order."""
    tied_in = {t: b for b, t in stage.tied.items()}
    cp = ("cp",) if context_parallel else ()
    split = set(stage.layout.expert_tensors)
    out = []
    for b in stage.blocks:
        for sp in stage.block_specs[b]:
            whole, copy, expert = sp.tp_dim is None, sp.name in stage.copies, sp.name in split
            partial = whole and (sequence_parallel or sp.tp_partial)
            replicas = (("ep-dp", "sharding") if expert else REPLICAS) + cp
            over = (("tied",) if sp.name in tied_in else ()) + replicas + (("tp",) if partial else ())
            out.append(Reduction(sp.name, tied_in.get(sp.name, b), over, copy, not copy and not (whole and tp_rank > 0),
                                 ("ep",) if expert else ()))
    return tuple(out)


def expert_sums(reds) -> list[str]:
    """Tensors whose squares are summed over expert-parallel ranks in the global norm, in layout order."""
    return [r.tensor for r in reds if "ep" in r.norm_over]


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
