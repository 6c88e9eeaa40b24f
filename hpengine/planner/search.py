"""`hpengine plan`: rank the legal layouts of a model on a cluster (planner/space.py) by predicted step time
among those whose predicted memory fits, by branch and bound (planner/prune.py) or exhaustively, print the table
(planner/report.py) and write the best as a config; `--check` predicts one config; `--calibrate` measures this
machine; and a job's start-up makes its one prediction here (predict_at_start) and logs it.
"""
from __future__ import annotations

import copy
import os
import textwrap
import time

from hpengine.config.load import (
    Config,
    ConfigError,
    enabled_strategies,
    load_config,
    to_toml,
    validate,
)
from hpengine.data.format import DataError
from hpengine.files import write_file
from hpengine.layout.resolve import SWITCH_OF_AXIS, Resolved, resolve
from hpengine.planner import documents as plan_docs, islands as plan_islands, prune
from hpengine.planner.calibrate import GB, calibrate_device
from hpengine.planner.cluster import Cluster, PlanError, load_cluster  # noqa: F401 - Cluster and PlanError are part of plan's API
from hpengine.planner.model import predict_layout, predict_stage, step_time  # noqa: F401 - predict_layout is part of plan's API
from hpengine.planner.report import (_bytes, _n_params, _secs, check_text, describe, hidden_line,  # noqa: F401
                                     billions, size_notes, table)
from hpengine.planner.space import candidates, rank_key  # noqa: F401 - candidates is part of plan's API
from hpengine.planner.presets import ALIASES, PRESETS, model_config


def with_preset(cfg: Config, name: str) -> Config:
    """cfg with its [model] table replaced by a preset's (presets.py) and its global batch set."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise PlanError(f"--model {name}: unknown preset; choose one of {', '.join(PRESETS)} "
                        f"(aliases: {', '.join(f'{a} = {k}' for a, k in ALIASES.items())})")
    preset = PRESETS[key]
    cfg = copy.deepcopy(cfg)
    cfg.model = model_config(key)
    cfg.train.global_batch = preset.global_batch
    return cfg


def with_optimizer(cfg: Config, name: str | None) -> Config:
    """cfg planned for the optimizer `name` (`--optimizer`; None: the config's optim.name)."""
    if name is None:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.optim.name = name
    validate(cfg)
    return cfg


# ---- search -----------------------------------------------------------------------------------------

def search(cfg: Config, cluster: Cluster, max_rows: int = 8, top: int | None = None, docs=None) -> tuple[list[dict], int]:
    """(layouts that fit in the device memory less the reserve, fastest first; how many were considered).
    top None: every layout evaluated and ranked (the exhaustive search); else branch and bound
    (planner/prune.py): the first `top` rows are the exhaustive search's, the rest only those it evaluated.
    Raises PlanError when none fits. docs: the plan's documents (planner/documents.py; None: one a row)."""
    fit, evaluated, pruned = searched(cfg, cluster, max_rows, top, docs=docs)
    return fit, evaluated + pruned


def searched(cfg: Config, cluster: Cluster, max_rows: int = 8, top: int | None = None, progress=None,
             where=None, docs=None) -> tuple[list[dict], int, int]:
    """search's ranking with (layouts evaluated, layouts pruned unevaluated); progress: a prune.SearchProgress;
    where(tp, cp, pp): only those prefixes (branch and bound only); docs: search's."""
    if top is not None:
        fit, n, pruned, smallest = prune.branch_and_bound(cfg, cluster, max_rows, top, progress, where,
                                                          1.0 if docs is None else docs.attention)
        if not n and not pruned:
            _none_legal(cfg, cluster)
        if not fit:
            _none_fits(smallest, cluster)
        return fit, n, pruned
    fit, smallest, n = [], None, 0
    for n, lay in enumerate(candidates(cfg, cluster, max_rows), 1):
        r = predict_layout(cfg, lay, cluster, (0, 1, lay.pp - 1), docs=docs)
        if r["memory"]["total"] <= cluster.usable_gb * GB:
            fit.append(r)
        elif smallest is None or r["memory"]["total"] < smallest["memory"]["total"]:
            smallest = r
    if not n:
        _none_legal(cfg, cluster)
    if not fit:
        _none_fits(smallest, cluster)
    fit.sort(key=rank_key)           # stable: among equals, the order of candidates
    return fit, n, 0


def _none_legal(cfg: Config, cluster: Cluster):
    raise PlanError(f"no legal layout of this model on {cluster.world} devices: global_batch = "
                    f"{cfg.train.global_batch} and the model's heads/widths admit no degrees that multiply to it")


def _none_fits(smallest: dict, cluster: Cluster):
    raise PlanError(f"no layout fits: the smallest needs {smallest['memory']['total'] / GB:.1f} GB per device "
                    f"({describe(smallest['layout'])}) but devices have {cluster.usable_gb:.4g} GB: "
                    f"{cluster.mem_gb:g} GB less {cluster.reserve:g} GB kept free (cluster.reserve_gb, "
                    "--reserve-gb)")


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

def _why_context(cfg: Config, cluster: Cluster, fit: list[dict], max_rows: int, docs=None) -> str:
    """Why the best layout splits sequences: no layout with cp 1 fits, or the best one that does is slower (the
    search again, over cp 1 only: the first search may have pruned those layouts)."""
    try:
        flat = searched(cfg, cluster, max_rows, 1, where=lambda tp, cp, pp: cp == 1, docs=docs)[0]
    except PlanError:
        flat = []
    if not flat:
        return (f"context parallel: memory: cp 1 does not fit ({cluster.usable_gb:.4g} GB usable per device); "
                f"each rank holds seq_len / cp tokens of every sequence")
    return (f"context parallel: time: the best layout with cp 1 ({describe(flat[0]['layout'])}) takes "
            f"{_secs(flat[0]['time']['step'])} a step, against {_secs(fit[0]['time']['step'])}")


def write_best(cfg: Config, best: dict, path: str, cluster: Cluster) -> Config:
    """Write the best layout as a runnable config TOML (a header names the strategies and prediction)."""
    c = config_for(cfg, best["layout"])
    degree = {SWITCH_OF_AXIS[a]: d for a, d in resolve(c, cluster.world).degrees.by_axis.items()}
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

def predict_at_start(cfg: Config, res: Resolved) -> dict:
    """The one prediction a job makes at start-up, for its layout decided for its backend (Resolved.on_device):
    "memory" per rank (the memory check reads it) and, with a cluster file in HPENGINE_CLUSTER, the step
    "time"; "limit": the device memory it is checked against, if known. memory None: none ("why")."""
    try:
        path, mem = os.environ.get("HPENGINE_CLUSTER"), os.environ.get("HPENGINE_DEVICE_MEMORY_GB")
        cluster = load_cluster(path) if path else None
        limit = float(mem) * GB if mem else (cluster.usable_gb * GB if cluster else None)
        r = predict_layout(cfg, res, cluster)
    except (ConfigError, ValueError, OSError, ArithmeticError) as e:
        return {"memory": None, "why": str(e)}
    return {**r, "limit": limit, "cluster_file": path}


def log_prediction(r: dict, log, rank: int = 0) -> None:
    """Log a start-up prediction (predict_at_start); warn when it exceeds the device memory."""
    m = r["memory"]
    if m is None:
        log.warning("plan: no prediction for this job (%s)", r["why"])
        return
    log.info("plan: predicted memory per rank (pp stage %d): %s", r["stage"],
             ", ".join(f"{k} {_bytes(v)}" for k, v in m.items()))
    if "time" in r:
        log.info("plan: predicted step %.3g s (compute %.3g s, bubble %.3g s) on the cluster in %s",
                 r["time"]["step"], r["time"]["compute"], r["time"]["bubble"], r["cluster_file"])
    if r["limit"] is not None and m["total"] > r["limit"] and rank == 0:
        log.warning("plan: predicted %s per rank exceeds the device memory of %s; try `hpengine plan`",
                    _bytes(m["total"]), _bytes(r["limit"]))


def check_at_start(cfg: Config, world: int, log, rank: int = 0, gpu: bool | None = None) -> dict | None:
    """predict_at_start and log_prediction for cfg on `world` ranks; gpu: whether the job runs on a GPU backend
    (what amp.bf16_storage = "auto" follows), when known."""
    lay = resolve(cfg, world)
    r = predict_at_start(cfg, lay if gpu is None else lay.on_device(gpu))
    log_prediction(r, log, rank)
    return r if r["memory"] is not None else None


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


def cluster_lines(a, c: Cluster) -> list[str]:
    """Which machine the plan assumes and where its figures come from: the --cluster file (its device as the
    file's first comment names it), the built-in default, and the flags that override either."""
    kind = "a generic device, no particular GPU"
    if a.cluster:
        with open(a.cluster, encoding="utf-8", errors="replace") as fh:
            first = fh.readline()
        kind = first.lstrip("# ").split(":")[0].split("(")[0].strip() if first.startswith("#") else "unnamed"
    where = f"--cluster {a.cluster}" if a.cluster else "the built-in default (--cluster FILE or the flags set yours)"
    flags = [f"--{k.replace('_', '-')}" for k in CLUSTER_FLAGS if getattr(a, k, None) is not None]
    return _wrap(f"cluster: {where}: {c.nodes} x {c.gpus_per_node} devices of {c.mem_gb:g} GB ({kind})"
                 + (f"; set by {', '.join(flags)}" if flags else "") + f"; {c.tflops:g} TFLOP/s 16-bit, "
                 f"{c.tflops_fp32:g} float32; links {c.intra_bw_gbs:g} GB/s and {c.intra_latency_us:g} us inside a "
                 f"node, {c.inter_bw_gbs:g} GB/s and {c.inter_latency_us:g} us between nodes"
                 + (f", {c.site_bw_gbs:g} GB/s and {c.site_latency_ms:g} ms between {c.sites} sites of {c.site_nodes} "
                    "nodes" if c.site_nodes else "") + f"; {c.reserve:g} GB kept free")


def documents(cfg: Config, mean=None):
    """The plan's DocumentFacts (planner/documents.py): --mean-doc-len, or the config's token files under
    data.document_mask; a token file that cannot be read is one line."""
    try:
        return plan_docs.documents_of(cfg, mean)
    except (DataError, OSError) as e:
        raise PlanError(f"data.document_mask: cannot measure the documents' lengths: {e}") from None


def _wrap(line: str) -> list[str]:
    return textwrap.wrap(line, 120, subsequent_indent="  ", break_on_hyphens=False) or [""]


def run(a, progress=None) -> str:
    """The `hpengine plan` command (arguments from cli/commands.py); returns the text to print. progress: a
    prune.SearchProgress the search reports to."""
    check_args(a)
    if a.calibrate:
        return calibrate_device(a.gpus_per_node, getattr(a, "device", "auto"))
    cluster = load_cluster(a.cluster, **{k: getattr(a, k) for k in CLUSTER_FLAGS})
    mean = getattr(a, "mean_doc_len", None)
    if a.check:
        cfg = with_optimizer(load_config(a.check, a.overrides), getattr(a, "optimizer", None))
        world = cluster.world if a.world is None else a.world
        docs = documents(cfg, mean)
        return "\n".join(cluster_lines(a, cluster) + _wrap(plan_docs.line(docs)) * (docs is not None)
                         + [check_text(cfg, world, cluster, docs)])
    cfg = load_config(a.config, a.overrides)
    cfg = with_preset(cfg, a.model) if a.model else cfg
    cfg = with_optimizer(cfg, getattr(a, "optimizer", None))
    if a.global_batch is not None:
        cfg.train.global_batch = a.global_batch
        validate(cfg)
    if getattr(a, "seq", None) is not None:
        cfg.model.seq_len = a.seq
        validate(cfg)
    docs = documents(cfg, mean)
    if a.out and os.path.lexists(a.out) and not getattr(a, "force", False):      # before a long search
        raise PlanError(f"--out {a.out}: the file already exists (pass --force to replace it)")
    t = time.perf_counter()
    fit, n, pruned = searched(cfg, cluster, a.max_micro_batch, a.top, progress, docs=docs)
    m = cfg.model
    out = cluster_lines(a, cluster) + _wrap(
        f"hpengine plan: {m.kind} {billions(_n_params(cfg), 3)} parameters (d_model {m.d_model}, {m.n_layers} layers, "
        f"seq {m.seq_len}; model.dtype {m.dtype}, amp rows compute in 16 bits), global batch "
        f"{cfg.train.global_batch}, on {cluster.world} devices, optimizer {cfg.optim.name}") + (
        _wrap(f"model: {size_notes(m)}") if size_notes(m) else []) + _wrap(
        f"searched {n + pruned:,} layouts in {time.perf_counter() - t:.1f} s: {n:,} evaluated, {pruned:,} pruned "
        f"unevaluated (floors that cannot fit or reach row {a.top}); times per optimizer step")
    out += _wrap(plan_docs.line(docs)) if docs is not None else []
    out += ["", table(fit, a.top, getattr(a, "wide", False), m.dtype), ""]
    out += _wrap(f"best: {describe(fit[0]['layout'])}")
    out += _wrap(hidden_line(fit[0], ", marked h in the table")) if hidden_line(fit[0]) else []
    if fit[0]["layout"].cp > 1:
        out += _wrap(_why_context(cfg, cluster, fit, a.max_micro_batch, docs))
    if cluster.sites > 1:           # a slow link between sites: its cost, and DiLoCo islands ranked apart
        out += [""] + plan_islands.report(cfg, cluster, fit[0], a.top, lambda c, cl: searched(
            c, cl, a.max_micro_batch, a.top, docs=docs)[0], config_for, docs)
    if a.out:
        try:
            write_best(cfg, fit[0], a.out, cluster)
        except OSError as e:
            raise PlanError(f"--out {a.out}: cannot write the config there ({e.strerror or e})") from None
        out += _wrap(f"wrote {a.out}: mpiexec -n {cluster.world} hpengine train {a.out}")
    return "\n".join(out)
