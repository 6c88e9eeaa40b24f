"""The layout a config gets on a world of N ranks, and every check that needs no communicator.
`resolve(cfg, world)` is pure (no MPI): degrees with the -1 filled in, mesh order, batch arithmetic,
pipeline chunks, the "switch off means neutral value" rule. The engine, the planner, trace.py and
train.py all read the `Resolved` it returns; nothing else derives a degree.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
from dataclasses import dataclass

from hpengine.config.load import MESH_AXES, ConfigError, ensure_valid, model_from_key, model_key
from hpengine.layout.degrees import AmpPolicy, BatchSplit, Degrees, PipelinePlan, TopologyError
from hpengine.layout.schedules import chunks_per_stage, placement, schedule
from hpengine.models import KINDS, build_model, capabilities
from hpengine.nn.context_split import check_split
from hpengine.optim.base import TENSORS, kind as optimizer_kind
from hpengine.params.buffers import partition

AXES = MESH_AXES          # innermost first by default
SWITCH_OF_AXIS = {"tp": "tensor_parallel", "cp": "context_parallel", "sharding": "sharding", "dp": "data_parallel",
                  "pp": "pipeline"}

MAX_INFLIGHT = 2   # blocks whose gradient reduction may be in flight at once (stages 2 and 3)


class LayoutError(ConfigError):
    """A config whose switches cannot run on this world size (one line naming the values)."""


class PipelineError(ValueError):
    pass


def split_blocks(blocks, p: int, v: int, split, param_count) -> list[list[str]]:
    """The model's blocks (models.Block, in order) cut into p·v consecutive chunks of block names; what
    precedes the first layer goes with the first chunk, what follows the last with the last.

    split: "uniform" (layers as even as possible), "params" (balanced by parameter count), or a list of
    layers per chunk."""
    names, P = [b.name for b in blocks], p * v
    layers = [b.name for b in blocks if b.kind == "layer"]
    L = len(layers)
    if P > L:
        raise PipelineError(f"pipeline.degree x virtual_stages = {p} x {v} = {P} chunks but the model has only "
                            f"{L} blocks (model.n_layers); use at most {L} chunks")
    if split == "params":
        rs = partition([param_count(b) for b in names], P, "tensor")
        sizes, out, i = [param_count(b) for b in names], [], 0
        for r in rs:
            chunk, acc = [], 0
            while i < len(names) and acc < r.size:
                chunk.append(names[i])
                acc += sizes[i]
                i += 1
            out.append(chunk)
        return out
    if split == "uniform":
        counts = [L // P + (1 if c < L % P else 0) for c in range(P)]
    else:
        counts = list(split)
        if len(counts) != P or sum(counts) != L or min(counts) < 1:
            raise PipelineError(f"pipeline.split = {counts}: needs {P} entries (degree x virtual_stages), each >= 1, "
                                f"summing to model.n_layers = {L}")
    first, last = names.index(layers[0]), names.index(layers[-1])
    chunks, start = [], 0
    for n in counts:
        chunks.append(layers[start:start + n])
        start += n
    chunks[0][:0] = names[:first]
    chunks[-1] += names[last + 1:]
    return chunks


def resolve_degrees(world: int, requested: dict) -> dict:
    """Replace the one degree of -1 by the ranks left over; check the product is the world size."""
    listing = lambda d: ", ".join(f"{a}={d[a]}" for a in AXES)  # noqa: E731
    free = [a for a in AXES if requested[a] == -1]
    if len(free) > 1:
        raise TopologyError(f"only one degree may be -1 (the ranks left over), got {listing(requested)} "
                            f"on a world of {world} ranks")
    fixed = math.prod(requested[a] for a in AXES if a not in free)
    degrees = dict(requested)
    if free:
        if world % fixed:
            raise TopologyError(f"degrees {listing(requested)}: the fixed degrees multiply to {fixed}, "
                                f"which does not divide the world size {world}")
        degrees[free[0]] = world // fixed
    if math.prod(degrees.values()) != world:
        raise TopologyError(f"degrees {listing(degrees)} multiply to {math.prod(degrees.values())} but the world "
                            f"size is {world}; make the product equal the number of ranks (mpiexec -n)")
    return degrees


def resolve_islands(cfg, world: int) -> tuple[int, int]:
    """(DiLoCo's islands, ranks per island): diloco.replicas, its -1 the ranks the inner degrees leave over; one
    island of the whole world when diloco is off."""
    dl = cfg.strategy.diloco
    if not dl.enable:
        return 1, world
    req = requested_degrees(cfg)
    if dl.replicas != -1:
        if world % dl.replicas:
            raise TopologyError(f"strategy.diloco.replicas = {dl.replicas} does not divide the world size {world}: "
                                f"use a divisor of {world}, or -1 (the ranks the inner degrees leave over)")
        return dl.replicas, world // dl.replicas
    free = [a for a in AXES if req[a] == -1]
    if free:
        raise TopologyError(f"strategy.diloco.replicas = -1 and {SWITCH_OF_AXIS[free[0]]}.degree = -1: only one "
                            "degree may be the ranks left over; give the islands or the inner degree a number")
    inner = math.prod(req.values())
    if world % inner:
        raise TopologyError(f"the inner degrees ({', '.join(f'{a}={req[a]}' for a in AXES)}) multiply to {inner}, "
                            f"which does not divide the world size {world}: strategy.diloco.replicas = -1 has no "
                            "whole number of islands")
    return world // inner, inner


@dataclass(frozen=True)
class Resolved:
    """One job's layout on a world size (switched-off means neutral), made of its parts: the parallel degrees,
    the pipeline's plan, the amp policy and the batch split (layout/degrees.py), and the settings of the
    gradient sync and of recompute. The part's names (tp, m, amp, share, ...) read through to the part."""
    degrees: Degrees
    pipeline: PipelinePlan = PipelinePlan()
    precision: AmpPolicy = AmpPolicy()
    batch: BatchSplit = BatchSplit()
    zstage: int = 0               # sharding stage, 0 when the sharding axis has one rank
    partition: str = "tensor"     # sharding.partition: "tensor" or "flat"
    bucket_mb: float = 4.0        # data_parallel.bucket_mb
    recompute: int = 0            # 0 = off, else every N-th layer
    granularity: str = "full"     # recompute.granularity: "full" or "selective"
    sp: bool = False              # sequence parallelism (tp > 1 only)
    cp_comm: str = "ring"         # context_parallel.comm: "ring" or "allgather"
    optimizer: str = "adamw"      # optim.name: what the planner counts of the optimizer's state
    muon_ns_steps: int = 5        # optim.muon_ns_steps: Newton-Schulz iterations the planner times (muon only)

    def on_device(self, gpu: bool) -> Resolved:
        """This layout with bf16_storage's "auto" decided for the backend: a GPU (gpu) or NumPy."""
        if self.bf16_storage != "auto":
            return self
        return dataclasses.replace(self, precision=dataclasses.replace(
            self.precision, bf16_storage="packed" if gpu else "float32"))

    def packs_activations(self, gpu: bool) -> bool:
        return self.precision.packs_activations(gpu)

    @property
    def seq_parts(self) -> int:
        """Pieces each sequence is cut into outside the tensor-parallel regions."""
        return self.tp if self.sp else 1

    @property
    def rows(self) -> int:
        """Sequences per micro-batch."""
        return self.share // (self.k * self.m)

    @property
    def grad_group(self) -> str:
        """The name of grad_axes' communicator (dist.topology.Mesh.group_name)."""
        return "*".join(self.grad_axes)

    def replica(self, coords: dict) -> int:
        return self.degrees.replica(coords)

    def selected(self, block) -> bool:
        """Whether recompute.every picks a block (models.Block): every N-th layer, never the embedding or head."""
        return bool(self.recompute) and block.kind == "layer" and block.layer % self.recompute == 0

    def recomputed(self, block) -> bool:
        """Whether a block keeps only its input in forward (granularity "full")."""
        return self.selected(block) and self.granularity == "full"

    def drops_scores(self, block) -> bool:
        """Whether a block keeps all but its attention probabilities in forward (granularity "selective")."""
        return self.selected(block) and self.granularity == "selective"


# the parts' names, read through on the layout: the planner's and the engine's arithmetic reads them by name
READ_THROUGH = {"degrees": ("tp", "cp", "sh", "dp", "pp", "ep", "order", "world", "grad_axes", "replicas",
                            "experts_whole", "islands"),
                "pipeline": ("m", "v", "schedule", "split", "scatter"),
                "precision": ("amp", "bf16_storage", "bf16_grads"),
                "batch": ("share", "k")}
for _part, _names in READ_THROUGH.items():
    for _name in _names:
        setattr(Resolved, _name, property(operator.attrgetter(f"{_part}.{_name}"), doc=f"{_part}.{_name}"))


def requested_degrees(cfg) -> dict:
    """{axis: degree} as the config asks (1 when the switch is off, -1 = the ranks left over)."""
    out = {}
    for a in AXES:
        table = getattr(cfg.strategy, SWITCH_OF_AXIS[a])
        out[a] = table.degree if table.enable else 1
    return out


def resolve(cfg, world: int) -> Resolved:
    """The layout of cfg on `world` ranks; raises LayoutError (or the topology's/pipeline's error) naming
    the offending values. Everything here is decided identically on every rank."""
    ensure_valid(cfg)
    s = cfg.strategy
    islands, inner = resolve_islands(cfg, world)
    d = resolve_degrees(inner, requested_degrees(cfg))
    pc, gm, rc = s.pipeline, s.gradient_merge, s.recompute
    sp = d["tp"] > 1 and s.tensor_parallel.sequence_parallel
    ep = s.expert_parallel.degree if s.expert_parallel.enable else 1
    res = Resolved(
        Degrees(d["tp"], d["cp"], d["sharding"], d["dp"], d["pp"], d["dp"] if ep == -1 else ep, tuple(cfg.mesh.order),
                islands),
        PipelinePlan(pc.micro_batches, chunks_per_stage(pc.schedule) or pc.virtual_stages, pc.schedule, pc.split,
                     d["tp"] > 1 and d["pp"] > 1 and not sp and pc.scatter_gather) if pc.enable else PipelinePlan(),
        AmpPolicy(s.amp.dtype if s.amp.enable else "", _bf16_storage(cfg),
                  s.amp.enable and s.amp.dtype == "bfloat16" and s.amp.grad_dtype == "bfloat16"),
        BatchSplit(cfg.train.global_batch // (islands * d["dp"] * d["sharding"]), gm.k_steps if gm.enable else 1),
        zstage=s.sharding.stage if d["sharding"] > 1 else 0, partition=s.sharding.partition,
        bucket_mb=s.data_parallel.bucket_mb, recompute=rc.every if rc.enable else 0,
        granularity=rc.granularity if rc.enable else "full", sp=sp, cp_comm=s.context_parallel.comm,
        optimizer=cfg.optim.name, muon_ns_steps=cfg.optim.muon_ns_steps)
    check(cfg, res)
    chunks(cfg.model, res)          # the pipeline split must be possible
    return res


def _bf16_storage(cfg) -> str:
    """Resolved.bf16_storage: amp.bf16_storage, its "auto" decided here when runtime.backend names one."""
    amp = cfg.strategy.amp
    if not (amp.enable and amp.dtype == "bfloat16"):
        return ""
    if amp.bf16_storage == "auto" and cfg.runtime.backend != "auto":
        return "packed" if cfg.runtime.backend == "cupy" else "float32"
    return amp.bf16_storage


def check(cfg, res: Resolved) -> None:
    """Batch arithmetic (every division exact), precision, recompute, tensor-parallel and schedule rules."""
    gb, replicas = cfg.train.global_batch, res.replicas * res.islands
    if gb % replicas:
        isl = "diloco.replicas x " if res.islands > 1 else ""
        isl_n = f"{res.islands} x " if res.islands > 1 else ""
        raise LayoutError(f"train.global_batch = {gb} is not divisible by {isl}dp x sharding = {isl_n}{res.dp} x "
                          f"{res.sh} = {replicas}; use a multiple of {replicas}")
    k, m = res.k, res.m
    if (gb // replicas) % (k * m):
        raise LayoutError(f"a replica's share of the batch ({gb} / {replicas} = {gb // replicas}) is not divisible "
                          f"by gradient_merge.k_steps x pipeline.micro_batches = {k} x {m}; make global_batch a "
                          f"multiple of {replicas * k * m}")
    amp, mc = cfg.strategy.amp, cfg.model
    if amp.enable and amp.dtype == "float16" and amp.grad_dtype != "float32":
        raise LayoutError(f"strategy.amp.grad_dtype = '{amp.grad_dtype}' applies to dtype = 'bfloat16' only "
                          "(float16 gradients are float16, scaled); leave it at 'float32'")
    if amp.enable and amp.dtype == "float16" and amp.bf16_storage != "auto":
        raise LayoutError(f"strategy.amp.bf16_storage = '{amp.bf16_storage}' applies to dtype = 'bfloat16' only "
                          "(float16 activations are float16 arrays); leave it at 'auto'")
    if amp.enable and mc.dtype != "float32":
        raise LayoutError(f"strategy.amp needs model.dtype = 'float32' (the master weights), got '{mc.dtype}'")
    rc = cfg.strategy.recompute
    if rc.enable and rc.every > mc.n_layers:
        raise LayoutError(f"strategy.recompute.every = {rc.every} is larger than the block count "
                          f"model.n_layers = {mc.n_layers}; use 1..{mc.n_layers}")
    _check_whole_tensors(cfg.optim.name, res)
    _check_fragments(cfg)
    if res.ep > 1:
        _check_expert_parallel(mc, res, cfg.optim.name)
    if res.cp > 1:
        _check_context_parallel(mc, res)
    tp = res.tp
    if tp > 1:
        bad = build_model(mc).tp_divides(tp)
        if bad:
            raise LayoutError(f"tensor_parallel.degree = {tp} must divide {bad}")
        if res.sp and (mc.seq_len // res.cp) % tp:
            per = f" (seq_len / context_parallel.degree = {mc.seq_len // res.cp})" if res.cp > 1 else ""
            raise LayoutError(f"strategy.tensor_parallel.sequence_parallel needs model.seq_len = {mc.seq_len}{per} "
                              f"divisible by tensor_parallel.degree = {tp}; use a multiple of {tp * res.cp} or turn it off")
    pc = cfg.strategy.pipeline
    kind = schedule(pc.schedule) if pc.enable else None
    if kind is not None and kind.chunks is None:
        if pc.virtual_stages < 2:
            raise LayoutError(f"pipeline.schedule = '{pc.schedule}' needs pipeline.virtual_stages >= 2, got "
                              f"{pc.virtual_stages}")
    elif kind is not None and kind.chunks > 1:
        if pc.virtual_stages not in (1, kind.chunks):
            raise LayoutError(f"pipeline.schedule = '{pc.schedule}' places {kind.chunks} model chunks per rank"
                              f"{' (a V)' if kind.vee else ''}; pipeline.virtual_stages = {pc.virtual_stages} must "
                              f"be {kind.chunks} (or left at 1)")
    elif pc.enable and pc.virtual_stages != 1:
        raise LayoutError(f"pipeline.virtual_stages = {pc.virtual_stages} needs pipeline.schedule = 'interleaved' "
                          f"(zbv always has 2; {pc.schedule} has 1)")
    if kind is not None and kind.groups_of_p and m % res.pp:
        raise LayoutError(f"pipeline.schedule = '{pc.schedule}' needs pipeline.micro_batches ({m}) to be a "
                          f"multiple of pipeline.degree ({res.pp})")
    if kind is not None and m < kind.min_micro_batches(res.pp):
        raise LayoutError(f"pipeline.schedule = '{pc.schedule}' needs pipeline.micro_batches >= 2 x degree - 1 = "
                          f"{kind.min_micro_batches(res.pp)} for degree {res.pp}, got {m}")


def _check_whole_tensors(name: str, res: Resolved) -> None:
    """An optimizer that updates whole tensors needs each owner's range to hold them whole: sharding by whole
    tensors (tensor-parallel slices and replicas are joined by strategies/whole_tensors.py)."""
    if optimizer_kind(name).sees == TENSORS and res.sh > 1 and res.partition != "tensor":
        raise LayoutError(f"optim.name = {name!r} updates whole tensors on their owner; strategy.sharding.partition "
                          f"= {res.partition!r} cuts them: use partition = 'tensor'")


def _check_fragments(cfg) -> None:
    """DiLoCo's streaming fragments are groups of whole tensors: no more of them than the models have tensors."""
    dl = cfg.strategy.diloco
    if dl.enable and dl.fragments > 1:
        n = len(build_model(cfg.model).all_specs()) * cfg.train.models
        if dl.fragments > n:
            raise LayoutError(f"strategy.diloco.fragments = {dl.fragments} is more than the {n} tensors of the "
                              f"model{'s' if cfg.train.models > 1 else ''} (a fragment is a group of whole tensors); "
                              f"use 1..{n}")


def expert_degrees(experts: int, dp: int, sh: int, optimizer: str) -> list[int]:
    """The legal expert-parallel degrees (the planner searches these): divisors of dp x sharding that divide the
    experts; one that does not divide dp spans sharding ranks, which an optimizer of whole tensors does not support."""
    whole_ok = optimizer_kind(optimizer).sees != TENSORS
    return [e for e in range(1, dp * sh + 1) if dp * sh % e == 0 and experts % e == 0 and (dp % e == 0 or whole_ok)]


def _check_expert_parallel(mc, res: Resolved, optimizer: str) -> None:
    """Expert parallel folds inside dp x sharding: a divisor of dp x sharding and of the experts. When it divides
    dp a sharding group holds one ep rank's experts and shards them as it shards the rest; otherwise each rank
    keeps its expert block whole, summed over the ranks that hold the same experts (Degrees.experts_whole)."""
    experts = capabilities(mc).experts
    if not experts:
        raise LayoutError(f"strategy.expert_parallel.degree = {res.ep} needs a model with routed experts "
                          "(model.kind = 'llama' or 'deepseek' and model.moe.num_experts > 0)")
    if experts % res.ep:
        raise LayoutError(f"strategy.expert_parallel.degree = {res.ep} must divide model.moe.num_experts = "
                          f"{experts}; valid: {[d for d in range(1, experts + 1) if experts % d == 0]}")
    n = res.dp * res.sh
    if n % res.ep:
        raise LayoutError(f"strategy.expert_parallel.degree = {res.ep} must divide data_parallel x sharding = "
                          f"{res.dp} x {res.sh} = {n} (experts are split inside those ranks; no extra ranks); valid: "
                          f"{expert_degrees(experts, res.dp, res.sh, optimizer)}")
    if res.experts_whole and optimizer_kind(optimizer).sees == TENSORS:
        raise LayoutError(f"optim.name = {optimizer!r} with strategy.expert_parallel.degree = {res.ep} across "
                          f"sharding ranks (it does not divide data_parallel.degree = {res.dp}) is not supported; "
                          f"use optim.name = 'adamw' or an ep degree that divides {res.dp}")


def _check_context_parallel(mc, res: Resolved) -> None:
    """Context parallel splits every sequence over cp ranks in 2 cp head-tail chunks; the attention of the
    gpt and llama kinds runs over them (the mlp kind mixes no positions: nothing to split for)."""
    caps = capabilities(mc)
    if not caps.attention:
        with_attention = ", ".join(repr(k) for k in KINDS if capabilities(dataclasses.replace(mc, kind=k)).attention)
        raise LayoutError(f"strategy.context_parallel needs a model with attention (model.kind = {with_attention}), "
                          f"got model.kind = '{mc.kind}'")
    if caps.experts and caps.capacity_factor > 0:
        raise LayoutError(f"strategy.context_parallel with model.moe.capacity_factor = {mc.moe.capacity_factor}: an "
                          "expert's capacity is filled in token order along each sequence, and a cp rank holds only "
                          "part of each; use capacity_factor = 0 (dropless) with context parallelism")
    try:
        check_split(mc.seq_len, res.cp)
    except ValueError as e:
        raise LayoutError(f"strategy.context_parallel: {e}") from None


def chunks(mcfg, res: Resolved) -> list[tuple[str, ...]]:
    """The model's block names cut into pp x v consecutive chunks (rank s holds chunks s, s + pp, ..., or
    s and 2 pp - 1 - s under zbv)."""
    split = tuple(res.split) if isinstance(res.split, list) else res.split
    return _chunks(_model_key(mcfg), res.pp, res.v, split)


def stage_chunks(mcfg, res: Resolved, stage: int) -> tuple[tuple[str, ...], ...]:
    """The chunks pipeline rank `stage` holds, in its local order (zbv: chunk 1 runs back up the pipe)."""
    every, place = chunks(mcfg, res), placement(res.schedule, res.pp, res.v)
    return tuple(every[place.virtual(stage, c)] for c in range(res.v))


def _model_key(mcfg) -> tuple:
    return model_key(mcfg)


@functools.lru_cache(maxsize=4096)
def _chunks(mkey, p, v, split) -> list[tuple[str, ...]]:
    model = build_model(model_from_key(mkey))
    count = lambda b: sum(math.prod(sp.global_shape) for sp in model.specs(b))  # noqa: E731
    return [tuple(c) for c in split_blocks(model.blocks(), p, v, list(split) if isinstance(split, tuple) else split,
                                           count)]


def describe(cfg, res: Resolved) -> str:
    """The resolved layout in words and numbers (`hpengine config CFG --world N`)."""
    shown = [a for a in reversed(res.order) if a != "cp" or res.cp > 1]
    isl = f"replica {res.islands} x " if res.islands > 1 else ""
    lines = [f"world {res.world}: " + isl + " x ".join(f"{a} {res.degrees.by_axis[a]}" for a in shown)
             + f" (mesh order innermost first: {', '.join(a for a in res.order if a in shown)})",
             *([f"diloco: {res.islands} islands of {res.degrees.island_size} rank(s), an outer step every "
                f"{cfg.strategy.diloco.inner_steps} steps, exchange {cfg.strategy.diloco.quantize}"]
               if res.islands > 1 or cfg.strategy.diloco.enable else []),
             f"batch: global {cfg.train.global_batch} = {res.replicas * res.islands} replica(s) x {res.share} sequences; "
             f"{res.k} pass(es) x {res.m} micro-batch(es) x {res.rows} sequences of {cfg.model.seq_len} tokens",
             "sharding: " + (f"stage {res.zstage}, partition {res.partition}" if res.zstage else "off"),
             "pipeline: " + (f"{res.schedule}, {res.v} chunk(s) per rank" if res.pp > 1 or res.m > 1 else "off"),
             "tensor parallel: " + (f"degree {res.tp}" + (", sequence parallel" if res.sp else "")
                                    + (", pipeline sends split across tp" if res.scatter else "") if res.tp > 1 else "off"),
             *([f"context parallel: degree {res.cp}, {res.cp_comm}; {cfg.model.seq_len // res.cp} tokens of each "
                f"sequence per rank in 2 head-tail chunks"] if res.cp > 1 else []),
             "recompute: " + (f"every {res.recompute} layer(s)" if res.recompute else "off")
             + (", selective" if res.recompute and res.granularity == "selective" else "")
             + f"; amp: {res.amp or 'off'}"]
    for s in range(res.pp):
        lines.append(f"  pp stage {s}: " + " | ".join(", ".join(ch) for ch in stage_chunks(cfg.model, res, s)))
    return "\n".join(lines)
