"""What one pipeline stage of a layout holds, reduced to counts for the planner: its blocks and their element
counts, its chunks and the shape facts the memory, traffic and time models read — cut as the engine cuts it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
from dataclasses import dataclass

from hpengine.config.load import model_from_key, model_key
from hpengine.layout.degrees import Degrees, PipelinePlan
from hpengine.layout.resolve import AXES, Resolved
from hpengine.layout.schedules import SCHEDULES
from hpengine.layout.stage import build_stage, owner
from hpengine.models import build_model, capabilities
from hpengine.optim.base import KINDS as OPTIMIZERS
from hpengine.optim.muon import is_muon_matrix


@dataclass(frozen=True)
class StageFacts:
    """One pipeline stage of one model, per tp rank (stage.build_stage's description reduced to counts):
    its blocks in layout order with their element counts (including another stage's tensors it keeps a
    copy of), its chunks, and shape facts."""
    blocks: tuple          # ((name, [tensor elements, ...]), ...)
    chunks: tuple          # block names per local chunk
    layers: int
    matmul: int            # elements of the weights this stage multiplies by (per tp rank)
    kinds: tuple = ()      # models.Block of each block, in layout order
    deps: tuple = ()       # (block, (blocks of this stage whose tensors it reads)), from stage.build_stage
    matmuls: tuple = ()    # (block, weight elements it multiplies by)
    tied: int = 0          # elements whose gradient is summed with another stage (a tied wte and its copy)
    replicated: tuple = ()  # per tensor (sizes' order, one model): whether every tp rank holds it whole
    experts: int = 0       # elements of the expert blocks split over ep (this rank's block; summed over ep-dp)
    expert: tuple = ()     # per tensor (sizes' order, one model): whether it is an expert block split over ep
    expert_mm: int = 0     # of `matmul`, the routed experts' share (top_k of them per token)
    partial: tuple = ()    # per tensor: held whole but applied to this tp rank's heads only (ParamSpec.tp_partial)
    unpacked: tuple = ()   # (block, elements of its tensors packed bf16 unpacks: all but the linears' weights)
    muon: tuple = ()       # per tensor (sizes' order, one model): (count, rows, cols, expert) of a Muon matrix whole
    #                        (over tp), count: the routed experts this rank holds; None: not one (optim.muon)
    state_values: tuple = ()  # (optimizer, its state values per element of each tensor, sizes' order, one model) for
    #                           each optimizer that declares them per tensor (optim.base.OptimizerKind.values)
    specs: tuple = ()      # per tensor (sizes' order, one model): its ParamSpec (DiLoCo's blocks of whole tensors)
    attention: float = 1.0  # the share of the attention's score and value work packed documents leave
    #                         (planner/documents.py; 1: one document a row)

    def sizes(self, models: int) -> tuple:
        """Tensor element counts in layout order, for `models` models sharing the buffer."""
        return memoised(self, ("sizes", models), lambda: tuple(n for _ in range(models) for _, sz in self.blocks
                                                               for n in sz))

    def block(self, name: str) -> int:
        return self.block_sizes[name]

    @functools.cached_property
    def block_sizes(self) -> dict:
        return {name: sum(sz) for name, sz in self.blocks}

    @functools.cached_property
    def memo(self) -> dict:
        """Figures derived from this stage, keyed by what else they read (the search asks for the same ones many
        times; a StageFacts is immutable, so they never go stale)."""
        return {}

    @functools.cached_property
    def kind_of(self) -> dict:
        """{block name: models.Block}, built once per stage (the search asks for every block of every layout)."""
        return {b.name: b for b in self.kinds}

    def of_kind(self, kind: str) -> list[str]:
        return [b.name for b in self.kinds if b.kind == kind]

    @property
    def psi(self) -> int:
        return sum(sum(sz) for _, sz in self.blocks)

    @property
    def names(self) -> list[str]:
        return [b for b, _ in self.blocks]


# what a layout's sharding x dp split sets; every other field of Resolved is the family's (planner/prune.py)
SPLIT_FIELDS = ("sh", "dp", "zstage", "partition")
_FAMILY_FIELDS = tuple(f.name for f in dataclasses.fields(Resolved) if f.name not in SPLIT_FIELDS)


_family_of = operator.attrgetter(*_FAMILY_FIELDS)
# what a micro-batch's compute reads of a layout (model.compute_s: its GEMMs, caches and recompute), beside the
# stage: not the schedule, the number of micro-batches (only their size), the mesh order or the pipeline sends
_micro_batch_of = operator.attrgetter("tp", "rows", "share", "cp", "cp_comm", "amp", "recompute", "granularity", "sp",
                                      "ep", "bf16_storage", "bf16_grads")


def family_key(lay: Resolved) -> tuple:
    """Every field of the layout but its sharding x dp split: the key of figures that do not read the split."""
    key = _family_of(lay)
    return key if not isinstance(lay.split, list) else tuple(tuple(v) if isinstance(v, list) else v for v in key)


def micro_batch_key(lay: Resolved) -> tuple:
    """The fields of a layout one micro-batch's compute through a stage reads (model.compute_s)."""
    return _micro_batch_of(lay)


def memoised(st: StageFacts, key: tuple, compute):
    """st.memo[key], computed once."""
    if key not in st.memo:
        st.memo[key] = compute()
    return st.memo[key]


def stages(mcfg, tp: int, p: int, v: int, split="uniform", schedule: str = "fthenb", ep: int = 1,
           attention: float = 1.0) -> list[StageFacts]:
    """Every pipeline stage of the model, cut as the engine cuts it (schedule: where the chunks sit; only
    zbv's V differs from c * p + stage; ep: the expert blocks a rank holds, 1 / ep of the experts; attention:
    StageFacts.attention)."""
    key = tuple(split) if isinstance(split, list) else split
    vee = next(s.name for s in SCHEDULES.values() if s.vee)     # stages depend on the placement alone
    return _stages(model_key(mcfg), tp, p, v, key, vee if SCHEDULES[schedule].vee else "fthenb", ep, float(attention))


@functools.lru_cache(maxsize=4096)
def _stages(mkey, tp, p, v, split, schedule, ep=1, attention=1.0) -> list[StageFacts]:
    if attention != 1.0:     # the same cut with its share (fresh instances: each keeps its own memo of figures)
        return [dataclasses.replace(st, attention=attention) for st in _stages(mkey, tp, p, v, split, schedule, ep, 1.0)]
    mcfg = model_from_key(mkey)
    res = Resolved(Degrees(tp, 1, 1, 1, p, ep, AXES),
                   PipelinePlan(1, v, schedule, list(split) if isinstance(split, tuple) else split))
    model = build_model(mcfg, tp)
    return [_stage(mcfg, res, model, tp, ep, s) for s in range(p)]


def _stage(mcfg, res, model, tp: int, ep: int, s: int) -> StageFacts:
    st = build_stage(mcfg, res, s, 0, models=[model])
    slot, lay = st.slots[0], st.layout
    blocks, matmuls, replicated, expert, partial, expert_mm, unpacked, muon = [], [], [], [], [], 0, [], []
    held = []
    values = {name: [] for name, k in OPTIMIZERS.items() if k.values is not None}
    depth, mtp_layers = capabilities(mcfg).mtp_depth, 0
    for name in slot.blocks:
        b = slot.block(name)
        specs = st.block_specs[name]
        sizes = [lay.ranges[sp.name].size for sp in specs]
        mm = 0
        if b.kind != "embed":   # embedding lookups are no matmul; a copied tensor counts as a read below
            mm += sum(n for sp, n in zip(specs, sizes) if len(sp.global_shape) == 2 and sp.name not in st.copies)
            # routed experts (E, in, out): each token meets top_k of the E matrices, wherever they are held
            moe = model.moe
            routed = sum(n * lay.ep_size * moe.k // moe.E for sp, n in zip(specs, sizes)
                         if len(sp.global_shape) == 3) if moe else 0
            mm, expert_mm = mm + routed, expert_mm + routed
        for t in b.reads:       # a tied head multiplies by wte, held here or by the embedding block
            read = next(math.prod(sp.local_shape(0, tp)) for sp in model.specs(owner(model, t)) if sp.name == t)
            mm += read if mcfg.tie_head or b.kind != "head" else 0     # else multi-token prediction looks it up
        if b.kind == "head" and depth:      # multi-token prediction: each depth's block, and the shared head again
            head = sum(n for sp, n in zip(specs, sizes) if sp.name == "lm_head.w") or read
            mm, mtp_layers = mm + depth * head, depth
        blocks.append((name, tuple(sizes)))
        held += specs
        replicated += [sp.tp_dim is None for sp in specs]
        expert += [sp.ep_dim is not None and ep > 1 for sp in specs]
        partial += [sp.tp_dim is None and sp.tp_partial for sp in specs]
        muon += [_muon_shape(sp, lay.shapes[sp.name]) if is_muon_matrix(sp) else None for sp in specs]
        for opt, per in values.items():
            per += [OPTIMIZERS[opt].values(sp) for sp in specs]
        matmuls.append((name, mm))
        unpacked.append((name, sum(n for sp, n in zip(specs, sizes) if not model.gemm_weight(sp.name))))
    kinds = tuple(slot.block(n) for n in slot.blocks)
    # layers: the attention passes (FLOPs, tp and cp exchanges), a multi-token prediction module's among them
    return StageFacts(tuple(blocks), slot.chunks, sum(k.kind == "layer" for k in kinds) + mtp_layers,
                      sum(n for _, n in matmuls),
                 kinds, tuple(st.deps.items()), tuple(matmuls),
                 sum(lay.ranges[t].size for t in set(st.tied.values())), tuple(replicated),
                 sum(lay.ranges[sp.name].size for sp in lay.specs if sp.ep_dim is not None and ep > 1),
                 tuple(expert), expert_mm=expert_mm, partial=tuple(partial), unpacked=tuple(unpacked),
                 muon=tuple(muon), state_values=tuple((name, tuple(per)) for name, per in values.items()),
                 specs=tuple(held))


def _muon_shape(spec, local) -> tuple:
    """(count, rows, cols, expert) of a Muon matrix whole, or of each of the routed experts of a stack this rank
    holds (expert: True, their work divided over their own replicas)."""
    whole = tuple(spec.global_shape[-2:])
    return (1, *whole, False) if len(whole) == len(local) else (local[0], *whole, True)
