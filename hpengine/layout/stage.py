"""One pipeline stage as data: which blocks of which models this rank holds, their tensors in the flat
buffer (including the copy of a tensor a block reads from another stage, e.g. a tied head's wte), which
blocks read each other's tensors, and which tensors are summed with another stage. Built once, frozen;
the engine, the gradient-sync strategies and the planner all read this one description.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType

from hpengine.layout.resolve import Resolved, stage_chunks
from hpengine.models import build_model
from hpengine.params.buffers import Layout, Range


@dataclass(frozen=True)
class Slot:
    """One model's part of the stage: its object, name prefix, seed, peak lr, chunks and buffer range."""
    index: int
    model: object
    prefix: str
    seed: int
    lr: float
    chunks: tuple          # unprefixed block names per local chunk
    blocks: tuple          # prefixed block names, layout order
    range: Range
    structure: MappingProxyType   # unprefixed block name -> models.Block

    def block(self, name: str):
        """The models.Block of an unprefixed block name."""
        return self.structure[name]


@dataclass(frozen=True)
class Stage:
    """What a pipeline rank holds; every name is prefixed ("m{i}." with several models)."""
    layout: Layout
    slots: tuple
    blocks: tuple                  # layout order
    block_specs: MappingProxyType  # block -> its ParamSpecs
    block_ranges: MappingProxyType  # block -> Range of the flat buffer
    deps: MappingProxyType         # block -> other blocks of this stage whose tensors it reads
    tied: MappingProxyType         # block -> tensor whose gradient is summed with another stage's copy first
    copies: frozenset              # tensors that are copies of another stage's (counted there, not here)
    seed: int                      # the job's seed (a spec's own seed wins)

    @property
    def done_order(self) -> list[str]:
        """Blocks in the order backward finishes them (models one after another)."""
        return [b for s in self.slots for b in reversed(s.blocks)]


def _block_map(model) -> dict:
    return {b.name: b for b in model.blocks()}


def owner(model, tensor: str) -> str:
    """The block that declares `tensor`."""
    for b in model.blocks():
        if any(sp.name == tensor for sp in model.specs(b.name)):
            return b.name
    raise KeyError(f"no block of the model declares tensor {tensor!r}")


def build_stage(mcfg, res: Resolved, pp_rank: int, tp_rank: int = 0, seeds=(0,), lrs=(0.0,),
                models=None, ep_rank: int = 0) -> Stage:
    """The stage of pipeline rank `pp_rank` (tensor slices of tp rank `tp_rank`, the expert block of ep rank
    `ep_rank`) for len(seeds) models."""
    n = len(seeds)
    models = models or [build_model(mcfg, res.tp) for _ in range(n)]
    here = stage_chunks(mcfg, res, pp_rank)
    mine = [b for ch in here for b in ch]
    specs, deps, tied, copies, parts = [], {}, {}, set(), []
    for i, model in enumerate(models):
        prefix = f"m{i}." if n > 1 else ""
        blocks = _block_map(model)
        for b in mine:
            bspecs = list(model.specs(b))
            for t in blocks[b].reads:
                src = owner(model, t)
                if src in mine:
                    deps.setdefault(prefix + b, []).append(prefix + src)
                else:           # a copy here; its gradient is summed with the owner's stage
                    bspecs.insert(0, dataclasses.replace(next(s for s in model.specs(src) if s.name == t), block=b))
                    copies.add(prefix + t)
                    tied[prefix + b] = prefix + t
            ours = {sp.name for sp in bspecs}
            for other in blocks.values():     # a block elsewhere keeps a copy of one of ours
                for t in other.reads:
                    if other.name not in mine and t in ours:
                        tied[prefix + b] = prefix + t
            specs += [dataclasses.replace(sp, name=prefix + sp.name, block=prefix + b, init_key=sp.name,
                                          seed=seeds[i]) for sp in bspecs]
        parts.append((i, model, prefix, tuple(prefix + b for b in mine), MappingProxyType(blocks)))
    layout = Layout(specs, tp_rank, res.tp, ep_rank, res.ep)
    block_specs = {}
    for sp in specs:
        block_specs.setdefault(sp.block, []).append(sp)
    ranges = {b: Range(layout.ranges[v[0].name].start, layout.ranges[v[-1].name].stop) for b, v in block_specs.items()}
    slots = tuple(Slot(i, model, prefix, seeds[i], lrs[i], here, bl, Range(ranges[bl[0]].start, ranges[bl[-1]].stop),
                       structure) for i, model, prefix, bl, structure in parts)
    return Stage(layout, slots, tuple(b for s in slots for b in s.blocks),
                 MappingProxyType({b: tuple(v) for b, v in block_specs.items()}), MappingProxyType(ranges),
                 MappingProxyType({b: tuple(v) for b, v in deps.items()}), MappingProxyType(tied), frozenset(copies),
                 seeds[0])
