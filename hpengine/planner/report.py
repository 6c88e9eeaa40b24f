"""What `hpengine plan` prints: a layout in words (describe), the ranked table with its legend (narrow by
default, --wide for every part), the hidden-communication line, and `plan --check`'s per-stage report.
"""
from __future__ import annotations

import math

from hpengine.config.load import Config
from hpengine.layout.degrees import Degrees
from hpengine.layout.resolve import Resolved, resolve
from hpengine.models import build_model, capabilities
from hpengine.planner.calibrate import GB
from hpengine.planner.cluster import Cluster, PlanError
from hpengine.planner.model import predict_layout

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
NARROW_TIME = ("compute", "bubble", "comm", "step")
COMM = ("tp", "pp", "ep", "cp", "dp", "sharding")
SHORT = {"optimizer": "optim", "activations": "act", "buffers": "buf", "sharding": "shard"}
# (column, width, what the legend says)
LAYOUT_COLS = (("#", 2, "rank"), ("tp", 2, "tensor parallel degree"), ("cp", 2, "context parallel degree"),
               ("pp", 3, "pipeline stages"), ("dp", 4, "data parallel replicas"),
               ("ep", 3, "expert parallel degree (inside dp)"), ("sh", 4, "sharding (ZeRO) degree"),
               ("st", 2, "ZeRO stage"), ("sched", 9, "pipeline schedule/chunks per rank"),
               ("m", 4, "micro-batches per pass"), ("k", 3, "gradient-merge passes"),
               ("mb", 2, "sequences per micro-batch"), ("sp", 2, "sequence parallel"),
               ("rc", 2, "recompute: f full, s selective"), ("amp", 4, "compute precision"))


def _unit(largest: float, units) -> tuple:
    for scale, name in units:
        if largest >= scale:
            return scale, name
    return units[-1]


def row_precision(lay: Resolved, dtype: str) -> str:
    """A row's compute precision: fp16 / bf16 under amp (float32 master weights), else the model's dtype."""
    if lay.amp:
        return "bf16" if lay.amp == "bfloat16" else "fp16"
    return {"float32": "fp32", "float64": "fp64"}.get(dtype, dtype)


def _cells(lay: Resolved, i: int, dtype: str, cols) -> list[str]:
    sched = "-" if lay.pp == 1 else lay.schedule + (f"/{lay.v}" if lay.v > 1 else "")
    value = {"#": i, "tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "sh": lay.sh,
             "st": lay.zstage or "-", "sched": sched, "m": lay.m, "k": lay.k, "mb": lay.rows,
             "sp": "y" if lay.sp else "-",
             "rc": lay.granularity[0] if lay.recompute else "-", "amp": row_precision(lay, dtype)}
    return [f"{value[c]:>{w}}" for c, w, _ in cols]


def table(results: list[dict], top: int, wide: bool = False, dtype: str = "float32") -> str:
    """The ranked table: layout, memory per device (worst stage), step time by part, then a legend. Narrow (the
    default, at most 120 columns): the total memory and the communication in one column, columns that are the
    same on every row left out; wide: every part."""
    rows = results[:top]
    ms, mn = _unit(max(r["memory"]["total"] for r in rows), [(GB, "GB"), (1e6, "MB"), (1, "B")])
    ts, tn = _unit(max(r["time"]["step"] for r in rows), [(1, "s"), (1e-3, "ms"), (1e-6, "us")])
    cols = [c for c in LAYOUT_COLS if wide or c[0] not in ("ep", "cp") or any(getattr(r["layout"], c[0]) > 1
                                                                                for r in rows)]
    mem, tcols = (MEM_COLS, TIME_COLS) if wide else (("total",), NARROW_TIME)
    mem_head = " ".join(f"{SHORT.get(c, c):>6}" for c in mem) + f" {mn}" if wide else f"{mn:>6}"
    head = (" ".join(f"{c:>{w}}" for c, w, _ in cols) + " | " + mem_head + " | "
            + " ".join(f"{SHORT.get(c, c):>7}" for c in tcols) + f" {tn} | {'tok/s':>9}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        t = dict(r["time"], comm=sum(r["time"][c] for c in COMM))
        mem_cells = " ".join(f"{r['memory'][c] / ms:>6.1f}" for c in mem) + (" " * (len(mn) + 1) if wide else "")
        lines.append(" ".join(_cells(r["layout"], i, dtype, cols)) + " | " + mem_cells + " | "
                     + " ".join(f"{t[c] / ts:>6.2f}" + ("h" if _hides(r, c) else " ") for c in tcols)
                     + " " * (len(tn) + 1) + f"| {r['tokens_per_s']:>9,.0f}")
    return "\n".join(lines + legend(cols, wide, dtype))


def legend(cols, wide: bool, dtype: str) -> list[str]:
    """What the table's abbreviations mean, wrapped under 120 columns."""
    items = [f"{c} {what}" for c, _, what in cols[1:]]
    plain = row_precision(Resolved(Degrees()), dtype)
    items[-1] += f" (fp16/bf16: amp, float32 master weights; {plain}: model.dtype)"
    items += [("params, grads, optim(izer), act(ivations), buf(fers), total: memory" if wide else "GB memory")
              + " per device, the worst pipeline stage" + ("" if wide else " (--wide: by part)"),
              "compute, bubble, " + ("tp, pp, ep, cp, dp, shard(ing): exposed communication by axis; fixed: "
                                     "optimizer and scalar sums" if wide else
                                     "comm: exposed communication (--wide: by axis and the optimizer's fixed time)"),
              "step: the time of an optimizer step", "h: partly hidden behind compute"]
    out, line = [], "legend:"
    for i, it in enumerate(items):
        piece = (" " if i == 0 else "; ") + it
        if len(line) + len(piece) > 119:
            out.append(line + ";")
            line = "  " + it
        else:
            line += piece
    return out + [line]


def _hides(r: dict, col: str) -> bool:
    """Whether some of the column's communication is hidden behind compute (marked h in the table)."""
    if col == "comm":
        return any(_hides(r, c) for c in COMM)
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


def billions(n: int, digits: int) -> str:
    """A parameter count in B to `digits` significant digits, in T from a trillion on."""
    return f"{n / 1e12:.{digits}g}T" if n >= 1e12 else f"{n / 1e9:.{digits}g}B"


def size_notes(mcfg) -> str:
    """What the header adds for a model with multi-token prediction or routed experts: the main model's parameters
    without the MTP modules, the parameters one token activates (its top_k routed experts of each MoE layer,
    every other tensor it multiplies by; not the input embedding, a lookup, unless the head is tied to it: what MFU
    counts, and the published "activated" figures), and the elements decoding caches per token of context."""
    model, caps = build_model(mcfg), capabilities(mcfg)
    if not caps.experts and not caps.mtp_depth:
        return ""
    extra = {sp.name for sp in model.mtp.specs()} if caps.mtp_depth else set()
    main = [sp for sp in model.all_specs() if sp.name not in extra]
    n = sum(math.prod(sp.global_shape) for sp in main)
    lookup = 0 if mcfg.tie_head else sum(math.prod(sp.global_shape) for sp in model.specs("embed"))
    experts = sum(math.prod(sp.global_shape) for sp in main if sp.ep_dim is not None)
    idle = experts * (caps.experts - caps.top_k) // caps.experts if caps.experts else 0
    out = [f"{billions(n, 4)} without the {caps.mtp_depth} multi-token prediction module(s)"] if extra else []
    out += [f"{billions(n - lookup - idle, 4)} activated per token"] if caps.experts else []
    out += [f"decoding caches {model.decode_cache_elements():,} elements per token of context"]
    return "; ".join(out)


def check_text(cfg: Config, world: int, cluster: Cluster, docs=None) -> str:
    """`plan --check`: per-stage memory, the step time and each communicator's bytes per step; docs: the
    plan's documents (planner/documents.py), their share of the attention's work."""
    try:
        lay = resolve(cfg, world)
    except ValueError as e:
        raise PlanError(f"--world {world}: {e}") from None
    try:
        r = predict_layout(cfg, lay, cluster, docs=docs)
    except ValueError as e:
        raise PlanError(f"--check on {world} ranks ({describe(lay)}): {e}") from None
    out = [f"{cfg.model.kind} with {_n_params(cfg):,} parameters on {world} ranks: {describe(lay)}; optimizer "
           f"{cfg.optim.name}",
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
    if "replica" in r:
        rep, t = r["replica"], r["time"]["step"]
        out.append(f"  diloco's islands meet every {cfg.strategy.diloco.inner_steps} steps: on {rep['link']} the "
                   f"replica bytes take {_secs(rep['seconds_per_step'])} per step, the step with them "
                   f"{_secs(t + rep['seconds_per_step'])}"
                   + (" (overlap: hidden where the inner steps between are longer)"
                      if cfg.strategy.diloco.overlap else ""))
    total, usable = r["memory"]["total"], cluster.usable_gb * GB
    room = f"headroom {_bytes(usable - total)}" if total <= usable else f"{_bytes(total - usable)} over"
    out.append(f"{'fits' if total <= usable else 'does NOT fit'} in {cluster.mem_gb:g} GB per device less "
               f"{cluster.reserve:g} GB kept free (worst stage {_bytes(total)}, {room})")
    return "\n".join(out)


