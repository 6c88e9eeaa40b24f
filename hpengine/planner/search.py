"""`hpengine plan`: enumerate the legal switch combinations and degrees for a model on a cluster, rank them
by the predicted step time among those whose predicted memory fits (planner/model.py), print the table and
write the best as a config; `--check` predicts one config; `--calibrate` measures this machine; and
train.py calls check_at_start to log the prediction for the job it runs.
"""
from __future__ import annotations

import copy
import math
import os
import time
from itertools import product

from hpengine.config.load import (
    Config,
    ConfigError,
    ModelConfig,
    MoEConfig,
    enabled_strategies,
    load_config,
    to_toml,
    validate,
)
from hpengine.files import write_file
from hpengine.layout.resolve import SWITCH_OF_AXIS, Resolved, resolve
from hpengine.models import build_model
from hpengine.planner.calibrate import GB, calibrate_device
from hpengine.planner.cluster import Cluster, PlanError, load_cluster  # noqa: F401 - Cluster and PlanError are part of plan's API
from hpengine.planner.model import evaluate, predict_stage, step_time  # noqa: F401 - evaluate is part of plan's API
from hpengine.planner.stages import stages
from hpengine.planner.presets import ALIASES, PRESETS


def with_preset(cfg: Config, name: str) -> Config:
    """cfg with its [model] table replaced by a preset's (presets.py) and its global batch set."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise PlanError(f"--model {name}: unknown preset; choose one of {', '.join(PRESETS)} "
                        f"(aliases: {', '.join(f'{a} = {k}' for a, k in ALIASES.items())})")
    preset = PRESETS[key]
    cfg = copy.deepcopy(cfg)
    cfg.model = ModelConfig(**{k: MoEConfig(**v) if k == "moe" else v for k, v in preset.model.items()})
    cfg.train.global_batch = preset.global_batch
    return cfg


# ---- search -----------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_ok(m, tp: int) -> bool:
    return not build_model(m).tp_divides(tp)


def _recompute_modes(m) -> list[tuple]:
    """(every, granularity) options: off, full, and selective where the model keeps attention probabilities."""
    scores = build_model(m).cache_bytes(1, 1, 1, False, 1)["scores"]
    return [(0, "full"), (1, "full")] + ([(1, "selective")] if scores else [])


def candidates(cfg: Config, cluster: Cluster, max_rows: int = 8):
    """Every legal layout (resolve.Resolved) on the cluster: degrees that multiply to the world, tp within a
    node and dividing heads and widths (with and without sequence parallelism), exact batch arithmetic,
    each schedule, recompute (full, selective), amp, context parallel degrees (_context_degrees)."""
    m, W, gb = cfg.model, cluster.world, cfg.train.global_batch
    tps = [t for t in _divisors(W) if t <= cluster.gpus_per_node and _tp_ok(m, t)]
    modes, split_sends = _recompute_modes(m), cfg.strategy.pipeline.scatter_gather
    comm = cfg.strategy.context_parallel.comm
    for tp, cp, pp in [(t, c, p) for t in tps for c in _context_degrees(m, W // t)
                       for p in _divisors(W // (t * c)) if p <= m.n_layers]:
        tensors = min(len(st.sizes(cfg.train.models)) for st in stages(m, tp, pp, 1))
        sps = (False, True) if tp > 1 and (m.seq_len // cp) % tp == 0 else (False,)
        rest = W // (tp * cp * pp)           # ranks for sharding x dp (the replicas)
        for sh in [s for s in _divisors(rest) if gb % rest == 0]:
            dp, share = rest // sh, gb // rest
            rows = [r for r in _divisors(share) if r <= max_rows]
            for zstage, b, (rc, gran), amp, sp in product([0] if sh == 1 else [1, 2, 3], rows, modes, ("", "float16"),
                                                          sps):
                if cp > 1 and gran == "selective":      # the cp drivers keep no probabilities to drop
                    continue
                n = share // b          # micro-batches: the pipeline's, else gradient-merge passes
                for (sched, v), ep in product(_schedules(pp, n, m.n_layers), _expert_degrees(m, dp)):
                    yield Resolved(tp, sh, dp, pp, zstage, "tensor" if sh <= tensors else "flat",
                                   n if pp > 1 else 1, 1 if pp > 1 else n, v, sched, "uniform", rc, amp,
                                   tuple(cfg.mesh.order), share, cfg.strategy.data_parallel.bucket_mb, gran, sp,
                                   tp > 1 and pp > 1 and not sp and split_sends, ep, cp, comm)


def _context_degrees(m, ranks: int) -> list[int]:
    """Context-parallel degrees: divisors of the ranks left by tp whose 2 x degree divides model.seq_len;
    only 1 for the mlp kind (no attention) and MoE models (per-sequence balancing losses and capacity)."""
    if m.kind == "mlp" or (m.kind == "llama" and m.moe.num_experts):
        return [1]
    return [c for c in _divisors(ranks) if c == 1 or m.seq_len % (2 * c) == 0]


def _expert_degrees(m, dp: int) -> list[int]:
    """Expert-parallel degrees of an MoE model: divisors of dp that divide the experts (a sharding group holds
    one ep rank's experts and shards them)."""
    experts = m.moe.num_experts if m.kind == "llama" else 0
    if not experts:
        return [1]
    return [e for e in _divisors(dp) if experts % e == 0]


def _schedules(pp: int, m: int, layers: int):
    if pp == 1:
        return [("fthenb", 1)]
    out = [("fthenb", 1), ("1f1b", 1), ("zb1p", 1)]
    out += [("zbv", 2)] if m >= 2 * pp - 1 and 2 * pp <= layers else []
    return out + [("interleaved", v) for v in (2, 4) if m % pp == 0 and pp * v <= layers]


def search(cfg: Config, cluster: Cluster, max_rows: int = 8) -> tuple[list[dict], int]:
    """(layouts that fit in the device memory less the reserve, fastest first; how many were evaluated).
    Raises PlanError when none fits."""
    fit, smallest, n = [], None, 0
    for lay in candidates(cfg, cluster, max_rows):
        n += 1
        r = evaluate(cfg, lay, cluster, (0, 1, lay.pp - 1))
        if r["memory"]["total"] <= cluster.usable_gb * GB:
            fit.append(r)
        elif smallest is None or r["memory"]["total"] < smallest["memory"]["total"]:
            smallest = r
    if not n:
        raise PlanError(f"no legal layout of this model on {cluster.world} devices: global_batch = "
                        f"{cfg.train.global_batch} and the model's heads/widths admit no degrees that multiply to it")
    if not fit:
        raise PlanError(f"no layout fits: the smallest needs {smallest['memory']['total'] / GB:.1f} GB per device "
                        f"({describe(smallest['layout'])}) but devices have {cluster.usable_gb:.4g} GB: "
                        f"{cluster.mem_gb:g} GB less {cluster.reserve:g} GB kept free (cluster.reserve_gb, "
                        "--reserve-gb)")
    # equal step times: the layout that needs less memory first, then the one that sends less
    fit.sort(key=lambda r: (round(r["time"]["step"], 9), r["memory"]["total"], _sent(r)))
    return fit, n


def _sent(r: dict) -> int:
    """Bytes the worst stage's rank sends per step (ties in time and memory go to the layout that sends less)."""
    st = next(s for s in r["stages"] if s["stage"] == r["stage"])
    return sum(b for ops in st["traffic"].values() for op, b in ops.items() if op != "recv")


def config_for(cfg: Config, lay: Resolved) -> Config:
    """cfg with its strategy tables set to the layout (degrees explicit, so it runs on that world)."""
    c = copy.deepcopy(cfg)
    s = c.strategy
    on = {"data_parallel": lay.dp > 1, "sharding": lay.sh > 1, "pipeline": lay.pp > 1 or lay.m > 1 or lay.v > 1,
          "tensor_parallel": lay.tp > 1, "recompute": lay.recompute > 0, "gradient_merge": lay.k > 1, "amp": bool(lay.amp),
          "expert_parallel": lay.ep > 1, "context_parallel": lay.cp > 1}
    for name, enable in on.items():
        getattr(s, name).enable = enable
    sets = {"data_parallel": {"degree": lay.dp}, "sharding": {"degree": lay.sh, "stage": lay.zstage,
                                                              "partition": lay.partition},
            "pipeline": {"degree": lay.pp, "micro_batches": lay.m, "schedule": lay.schedule,
                         "virtual_stages": lay.v, "split": lay.split},
            "tensor_parallel": {"degree": lay.tp, "sequence_parallel": lay.sp},
            "recompute": {"every": lay.recompute, "granularity": lay.granularity},
            "gradient_merge": {"k_steps": lay.k}, "expert_parallel": {"degree": lay.ep},
            "context_parallel": {"degree": lay.cp, "comm": lay.cp_comm}}
    for name, values in sets.items():
        if on[name]:                   # a switched-off table keeps the user's values
            for key, value in values.items():
                setattr(getattr(s, name), key, value)
    validate(c)
    return c


# ---- output -----------------------------------------------------------------------------------------

def describe(lay: Resolved) -> str:
    """The switches of a layout in words: 'tp 8 x cp 2 (ring) x pp 4 (1f1b, 16 micro-batches) x sharding 2 (stage 1)'."""
    parts = [f"tp {lay.tp}" + (" (sequence parallel)" if lay.sp else "")] if lay.tp > 1 else []
    parts += [f"cp {lay.cp} ({lay.cp_comm})"] if lay.cp > 1 else []
    if lay.pp > 1:
        parts.append(f"pp {lay.pp} ({lay.schedule}{f' v={lay.v}' if lay.v > 1 else ''}, {lay.m} micro-batches)")
    parts += [f"dp {lay.dp}" + (f" (experts over ep {lay.ep})" if lay.ep > 1 else "")] if lay.dp > 1 else []
    parts += [f"sharding {lay.sh} (stage {lay.zstage})"] if lay.sh > 1 else []
    extra = ([f"gradient merge {lay.k}"] if lay.k > 1 else []) + ([f"{'selective ' if lay.granularity == 'selective' else ''}recompute"] if lay.recompute else []) \
        + (["amp"] if lay.amp else [])
    return " x ".join(parts or ["1 rank"]) + "".join(f", {e}" for e in extra) + f"; {lay.rows} seq per micro-batch"


MEM_COLS = ("params", "grads", "optimizer", "activations", "buffers", "total")
TIME_COLS = ("compute", "bubble", "tp", "pp", "ep", "cp", "dp", "sharding", "fixed", "step")
SHORT = {"optimizer": "optim", "activations": "act", "buffers": "buf", "sharding": "shard"}


def _unit(largest: float, units) -> tuple:
    for scale, name in units:
        if largest >= scale:
            return scale, name
    return units[-1]


def table(results: list[dict], top: int) -> str:
    """The ranked table: layout, memory per device (worst stage), step time by part."""
    rows = results[:top]
    ms, mn = _unit(max(r["memory"]["total"] for r in rows), [(GB, "GB"), (1e6, "MB"), (1, "B")])
    ts, tn = _unit(max(r["time"]["step"] for r in rows), [(1, "s"), (1e-3, "ms"), (1e-6, "us")])
    head = (f"{'#':>3} {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>4} {'ep':>3} {'sh':>4} {'st':>2} {'sched':>11} {'m':>4} {'k':>3} {'mb':>3} "
            f"{'sp':>2} {'rc':>2} {'amp':>3} | " + " ".join(f"{SHORT.get(c, c):>6}" for c in MEM_COLS) + f" {mn} | "
            + " ".join(f"{SHORT.get(c, c):>7}" for c in TIME_COLS) + f" {tn} | {'tok/s':>9}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        lay = r["layout"]
        sched = "-" if lay.pp == 1 else lay.schedule + (f"/{lay.v}" if lay.v > 1 else "")
        lines.append(f"{i:>3} {lay.tp:>3} {lay.cp:>3} {lay.pp:>3} {lay.dp:>4} {lay.ep:>3} {lay.sh:>4} {lay.zstage or '-':>2} {sched:>11} "
                     f"{lay.m:>4} {lay.k:>3} {lay.rows:>3} {'y' if lay.sp else '-':>2} "
                     f"{(lay.granularity[0] if lay.recompute else '-'):>2} "
                     f"{'y' if lay.amp else '-':>3} | " + " ".join(f"{r['memory'][c] / ms:>6.1f}" for c in MEM_COLS)
                     + "    | " + " ".join(f"{r['time'][c] / ts:>6.2f}" + ("h" if _hides(r, c) else " ") for c in TIME_COLS)
                     + f"    | {r['tokens_per_s']:>9,.0f}")
    return "\n".join(lines)


def _hides(r: dict, col: str) -> bool:
    """Whether some of the column's communication is hidden behind compute (marked h in the table)."""
    return any(t > 0 for what, (t, _) in r["time"].get("hidden", {}).items() if what.split()[0] == col)


def hidden_line(r: dict, legend: str = "") -> str:
    """Communication the prediction hides behind compute, with its bytes ("" when none)."""
    parts = [f"{what} {_bytes(b)} ({_secs(t)} hidden)" for what, (t, b) in r["time"].get("hidden", {}).items() if t > 0]
    return (f"hidden behind compute{legend} (per step, the rank with the most): " + ", ".join(parts)) if parts else ""


def _bytes(n: float) -> str:
    s, u = _unit(n, [(1e12, "TB"), (GB, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B")])
    return f"{n / s:.3g} {u}" if u != "B" else f"{int(n)} B"


def _secs(t: float) -> str:
    s, u = _unit(t, [(1, "s"), (1e-3, "ms"), (1e-6, "us")])
    return f"{t / s:.3g} {u}" if t else "0"


def _n_params(cfg: Config) -> int:
    return sum(math.prod(sp.global_shape) for sp in build_model(cfg.model).all_specs()) * cfg.train.models


def check_text(cfg: Config, world: int, cluster: Cluster) -> str:
    """`plan --check`: per-stage memory, the step time and each communicator's bytes per step."""
    try:
        lay = resolve(cfg, world)
    except ValueError as e:
        raise PlanError(f"--world {world}: {e}") from None
    try:
        r = evaluate(cfg, lay, cluster)
    except ValueError as e:
        raise PlanError(f"--check on {world} ranks ({describe(lay)}): {e}") from None
    out = [f"{cfg.model.kind} with {_n_params(cfg):,} parameters on {world} ranks: {describe(lay)}",
           "memory per device (bytes; the sharding rank with the largest share):"]
    for s in r["stages"]:
        out.append(f"  pp stage {s['stage']}: " + ", ".join(f"{k} {_bytes(v)}" for k, v in s["memory"].items()))
    t = r["time"]
    out.append("step time: " + ", ".join(f"{k} {_secs(t[k])}" for k in TIME_COLS)
               + f"; {r['tokens_per_s']:,.0f} tokens/s")
    if hidden_line(r):
        out.append(hidden_line(r))
    out.append(f"traffic per step (pp stage {r['stage']}, bytes each rank counts):")
    for axis, ops in next(s for s in r["stages"] if s["stage"] == r["stage"])["traffic"].items():
        out.append(f"  {axis}: " + ", ".join(f"{op} {_bytes(b)}" for op, b in ops.items()))
    total, usable = r["memory"]["total"], cluster.usable_gb * GB
    room = f"headroom {_bytes(usable - total)}" if total <= usable else f"{_bytes(total - usable)} over"
    out.append(f"{'fits' if total <= usable else 'does NOT fit'} in {cluster.mem_gb:g} GB per device less "
               f"{cluster.reserve:g} GB kept free (worst stage {_bytes(total)}, {room})")
    return "\n".join(out)


def _why_context(fit: list[dict], cluster: Cluster) -> str:
    """Why the best layout splits sequences: no layout with cp 1 fits, or the best one that does is slower."""
    flat = [r for r in fit if r["layout"].cp == 1]
    if not flat:
        return (f"context parallel: memory: cp 1 does not fit ({cluster.usable_gb:.4g} GB usable per device); "
                f"each rank holds seq_len / cp tokens of every sequence")
    return (f"context parallel: time: the best layout with cp 1 ({describe(flat[0]['layout'])}) takes "
            f"{_secs(flat[0]['time']['step'])} a step, against {_secs(fit[0]['time']['step'])}")


def write_best(cfg: Config, best: dict, path: str, cluster: Cluster) -> Config:
    """Write the best layout as a runnable config TOML (a header names the strategies and prediction)."""
    c = config_for(cfg, best["layout"])
    degree = {SWITCH_OF_AXIS[a]: d for a, d in resolve(c, cluster.world).degrees.items()}
    names = [f"{n}({degree[n]})" if n in degree else n for n in enabled_strategies(c)]
    head = [f"# hpengine plan for {cluster.world} devices ({cluster.nodes} x {cluster.gpus_per_node}, "
            f"{cluster.mem_gb:g} GB, {cluster.reserve:g} GB kept free): mpiexec -n {cluster.world} hpengine train "
            f"{os.path.basename(path)}",
            f"# strategies: {', '.join(names) or 'none (one rank)'}",
            f"# predicted: {best['memory']['total'] / GB:.2f} GB per device, step {best['time']['step']:.3g} s"]
    if c.model.vocab_size > 256 and not (c.data.path or getattr(c.data, "sources", None)):
        head.append(f"# data: model.vocab_size = {c.model.vocab_size} wants a token file built with its tokenizer "
                    "(hpengine data build DOCS --tokenizer tokenizer.json --out tokens.h5) as data.path; "
                    "empty, this trains on the built-in byte corpus")
    write_file(path, "\n".join(head) + "\n" + to_toml(c))      # a fresh file renamed into place, no link followed
    load_config(path)          # what we wrote must load back
    return c


# ---- at train start, calibration, command line ------------------------------------------------------

def check_at_start(cfg: Config, world: int, log, rank: int = 0, gpu: bool | None = None) -> dict | None:
    """Log the predicted per-rank memory (and step time with a cluster file in HPENGINE_CLUSTER);
    warn when it exceeds the device memory (HPENGINE_DEVICE_MEMORY_GB or that file's mem_gb). gpu: whether
    the job runs on a GPU backend (what amp.bf16_storage = "auto" follows), when known."""
    try:
        path, mem = os.environ.get("HPENGINE_CLUSTER"), os.environ.get("HPENGINE_DEVICE_MEMORY_GB")
        cluster = load_cluster(path) if path else None
        limit = float(mem) * GB if mem else (cluster.usable_gb * GB if cluster else None)
        lay = resolve(cfg, world)
        r = evaluate(cfg, lay if gpu is None else lay.on_device(gpu), cluster)
    except (ConfigError, ValueError, OSError) as e:
        log.warning("plan: no prediction for this job (%s)", e)
        return None
    m = r["memory"]
    log.info("plan: predicted memory per rank (pp stage %d): %s", r["stage"],
             ", ".join(f"{k} {_bytes(v)}" for k, v in m.items()))
    if cluster is not None:
        log.info("plan: predicted step %.3g s (compute %.3g s, bubble %.3g s) on the cluster in %s",
                 r["time"]["step"], r["time"]["compute"], r["time"]["bubble"], path)
    if limit is not None and m["total"] > limit and rank == 0:
        log.warning("plan: predicted %s per rank exceeds the device memory of %s; try `hpengine plan`",
                    _bytes(m["total"]), _bytes(limit))
    return r


CLUSTER_FLAGS = ("nodes", "gpus_per_node", "mem_gb", "intra_bw_gbs", "inter_bw_gbs", "intra_latency_us",
                 "inter_latency_us", "tflops", "tflops_fp32", "tflops_fp64",
                 "reserve_gb", "moe_imbalance")   # cli/commands.py's flags (the rest: --cluster)


def check_args(a) -> None:
    """One line naming a bad argument of `hpengine plan` and what is valid."""
    for flag, least in (("top", 1), ("global_batch", 1), ("seq", 2), ("world", 1), ("max_micro_batch", 1),
                        ("gpus_per_node", 1), ("nodes", 1)):
        v = getattr(a, flag, None)
        if v is not None and v < least:
            raise PlanError(f"--{flag.replace('_', '-')} {v}: must be an integer >= {least}")
    if getattr(a, "device", "auto") != "auto" and not a.calibrate:
        raise PlanError(f"--device {a.device}: only applies with --calibrate")
    if getattr(a, "world", None) is not None and not a.check:
        raise PlanError(f"--world {a.world}: only applies with --check CFG (the search uses --nodes x "
                        "--gpus-per-node)")
    if a.out and os.path.isdir(a.out):
        raise PlanError(f"--out {a.out}: is a folder; name the TOML file to write, e.g. --out "
                        f"{os.path.join(a.out, 'plan.toml')}")


def _cluster_line(a, c: Cluster) -> str:
    """Which machine the plan assumes: the --cluster file, else the built-in default, with its main figures."""
    where = f"--cluster {a.cluster}" if a.cluster else "the built-in default (--cluster FILE or the flags set yours)"
    return (f"cluster: {where}: {c.nodes} x {c.gpus_per_node} devices of {c.mem_gb:g} GB, {c.tflops:g} TFLOP/s "
            f"16-bit, {c.intra_bw_gbs:g} GB/s inside a node, {c.inter_bw_gbs:g} GB/s between nodes")


def run(a) -> str:
    """The `hpengine plan` command (arguments from cli/commands.py); returns the text to print."""
    check_args(a)
    if a.calibrate:
        return calibrate_device(a.gpus_per_node, getattr(a, "device", "auto"))
    cluster = load_cluster(a.cluster, **{k: getattr(a, k) for k in CLUSTER_FLAGS})
    if a.check:
        cfg = load_config(a.check, a.overrides)
        world = cluster.world if a.world is None else a.world
        return check_text(cfg, world, cluster)
    cfg = load_config(a.config, a.overrides)
    cfg = with_preset(cfg, a.model) if a.model else cfg
    if a.global_batch is not None:
        cfg.train.global_batch = a.global_batch
        validate(cfg)
    if getattr(a, "seq", None) is not None:
        cfg.model.seq_len = a.seq
        validate(cfg)
    if a.out and os.path.lexists(a.out) and not getattr(a, "force", False):      # before a long search
        raise PlanError(f"--out {a.out}: the file already exists (pass --force to replace it)")
    t = time.perf_counter()
    fit, n = search(cfg, cluster, a.max_micro_batch)
    out = [f"hpengine plan: {cfg.model.kind} {_n_params(cfg) / 1e9:.3g}B parameters (d_model {cfg.model.d_model}, "
           f"{cfg.model.n_layers} layers, seq {cfg.model.seq_len}, {cfg.model.dtype}), global batch "
           f"{cfg.train.global_batch}, on {cluster.nodes} x {cluster.gpus_per_node} devices of {cluster.mem_gb:g} GB",
           _cluster_line(a, cluster),
           f"{n:,} layouts evaluated in {time.perf_counter() - t:.1f} s, {len(fit):,} fit; memory per device is the "
           "worst pipeline stage's; times per optimizer step", "", table(fit, a.top), "",
           f"best: {describe(fit[0]['layout'])}"] + ([hidden_line(fit[0], ", marked h in the table")]
                                                     if hidden_line(fit[0]) else [])
    if fit[0]["layout"].cp > 1:
        out.append(_why_context(fit, cluster))
    if a.out:
        try:
            write_best(cfg, fit[0], a.out, cluster)
        except OSError as e:
            raise PlanError(f"--out {a.out}: cannot write the config there ({e.strerror or e})") from None
        out.append(f"wrote {a.out}: mpiexec -n {cluster.world} hpengine train {a.out}")
    return "\n".join(out)
