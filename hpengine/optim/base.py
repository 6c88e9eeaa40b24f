"""What an optimizer is to the engine, the checkpoint and the planner: the state tensors it keeps beside the
parameters it updates (their names are what a checkpoint stores and reshards), what it needs to see of a parameter
(element ranges of the flat buffer, or whole tensors), its state's size per parameter element, and the step after
each update (MuonClip's). Callers build them through `make` and `post_update` and never name an optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from hpengine.optim.adamw import AdamW
from hpengine.optim.muon import Muon, is_muon_matrix, ns_work
from hpengine.optim.qk_clip import NoPostUpdate, QKClip

RANGES, TENSORS = "ranges", "tensors"


class Optimizer(Protocol):
    """One optimizer's state over the parameters one rank updates (an element range of a flat buffer)."""
    t: int                                                      # updates applied (a checkpoint restores it)

    def state(self) -> dict[str, Any]:
        """Each state tensor by its checkpoint name, as an array over the elements of the tensors it covers (in
        the range's order; a tensor's values per element are its kind's values_of)."""

    def state_at(self, a: int) -> dict[str, int]:
        """For the elements from `a` (relative to the range) of one tensor: each state tensor that covers it and
        where its values for element a sit in that array."""

    def step(self, p, g, lr: float, grad_coef: float = 1.0, copy=None) -> None:
        """Update p in place from g x grad_coef; `copy`, when given, receives the new values (amp's copy)."""

    def nbytes(self) -> int:
        """Bytes of state held."""


class Whole(Protocol):
    """How an optimizer that sees TENSORS gets its per-tensor work done whole (strategies/ builds one from the
    communicators: tensor-parallel slices gathered to one rank, replicated tensors' work divided among replicas)."""

    def apply(self, names: list, parts: list, fn: Callable, where=None, dtype=None) -> list:
        """fn (a whole tensor -> an array of its shape) of each tensor `names[i]`, of which this rank holds
        parts[i] (its layout shape, stacks of matrices as (count, in, out)); returns this rank's part of each
        result. `where`: the Range the caller updates (an empty one where it holds none of its model), `dtype`:
        its arrays'. Collective over the ranks of the data-replica group, once per model and step on each: this
        rank may run fn on tensors it does not hold."""


@dataclass(frozen=True)
class OptimizerKind:
    """An optimizer as the rest of the engine knows it."""
    name: str
    state: tuple[str, ...]          # names of the state tensors, each over the elements of the tensors it covers
    sees: str                       # RANGES: any element range; TENSORS: whole tensors, on their owner
    build: Callable[..., Optimizer]  # (xp, layout, range, dtype, optim config, whole) -> Optimizer
    # TENSORS: the work of the update on a whole tensor (its spec, its whole shape; 0: none done whole), by
    # which the tensors' work is divided among the ranks that hold them
    work: Callable[[Any, tuple], int] | None = None
    # the state values a tensor (its spec) keeps per element: the first of `state` that many cover it; None: all
    values: Callable[[Any], int] | None = None
    fewest: int = 0                 # the values of the tensor that keeps the fewest (0: len(state))

    def values_of(self, spec) -> int:
        """State values per element of the tensor `spec` describes."""
        return len(self.state) if self.values is None else self.values(spec)

    def state_bytes(self, item: int, least: bool = False) -> int:
        """Bytes of optimizer state per parameter element, state held at `item` bytes a value: on the tensors that
        keep the most (least: the fewest, a floor whatever the tensors are)."""
        n = (self.fewest or len(self.state)) if least else len(self.state)
        return n * item


def _adamw(xp, layout, r, dtype, o, whole=None) -> Optimizer:
    return AdamW(xp, layout, r, dtype, tuple(o.betas), o.eps, o.weight_decay)


def _muon(xp, layout, r, dtype, o, whole=None) -> Optimizer:
    return Muon(xp, layout, r, dtype, o, whole)


def _muon_work(spec, shape) -> int:
    return ns_work(shape) if is_muon_matrix(spec) else 0


def _muon_values(spec) -> int:
    return 1 if is_muon_matrix(spec) else 2


KINDS: dict[str, OptimizerKind] = {
    "adamw": OptimizerKind("adamw", AdamW.STATE, RANGES, _adamw),
    # Muon's matrices keep one momentum (muon_m), the rest Adam's two moments (muon_m and muon_v)
    "muon": OptimizerKind("muon", Muon.STATE, TENSORS, _muon, _muon_work, _muon_values, 1),
}
UNDECLARED = "adamw"     # the optimizer of a checkpoint whose manifest names none (written before they did)


def kind(name: str) -> OptimizerKind:
    """The optimizer called `name` (optim.name); a ValueError naming the valid ones otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"optim.name = {name!r} is not an optimizer hpengine has; "
                         f"valid: {', '.join(sorted(KINDS))}") from None


def make(optim_cfg, xp, layout, r, dtype, whole: Whole | None = None) -> Optimizer:
    """The optimizer `optim_cfg.name` over range r of a flat buffer, its state in `dtype`; `whole` (TENSORS
    kinds): how its whole-tensor work is divided (None: every tensor is whole here and done here)."""
    return kind(optim_cfg.name).build(xp, layout, r, dtype, optim_cfg, whole)


def post_update(optim_cfg, model, layout, own, xp, to_host, max_all, tp_rank: int = 0, tp_size: int = 1,
                prefix: str = ""):
    """What runs after each update over the owned range `own` of a stage's layout: Muon's QK-Clip when
    optim.muon_qk_clip > 0 (max_all: an elementwise max of a host array over every rank), else nothing. Its
    context(ctx) is the context the layers must be handed, begin_step() starts a step's collection and
    apply(p, copy) runs after the update."""
    if optim_cfg.name == "muon" and optim_cfg.muon_qk_clip > 0:
        return QKClip(optim_cfg.muon_qk_clip, model, layout, own, xp, to_host, max_all, tp_rank, tp_size, prefix)
    return NoPostUpdate()
