"""Where the run's time goes. A Tracer keeps per-category phase timers (always on) and, with `runtime.trace`,
a bounded per-rank timeline; at the end the timelines are merged into one Chrome trace JSON (trace.json)
and the breakdown is logged and written to breakdown.json.
"""
from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path

from mpi4py import MPI

from hpengine.dist.tracer import OFF, Tracer  # noqa: F401 - part of trace's API
from hpengine.engine.state import reference_order_specs
from hpengine.files import write_file

log = logging.getLogger("hpengine")
_now = time.perf_counter_ns
CLOCK_TAG = 31_337           # ping-pong tag of the clock alignment (no other message is in flight then)

# (category, label) in table order; the label's {comms} names the communicators that category waits on
CATEGORIES = [
    ("forward", "compute: forward"), ("backward", "compute: backward"),
    ("weights", "compute: weight gradients (zero-bubble W)"), ("pipeline idle", "pipeline idle (recv waits)"),
    ("grad sync wait", "comm: gradient sync wait ({grads})"), ("optimizer", "optimizer (incl. global-norm allreduce)"),
    ("param share", "comm: parameter share ({params})"), ("loss sync", "comm: loss allreduce"),
    ("data", "data loading"), ("eval", "evaluation"), ("checkpoint", "checkpoint save"),
]



def comms_of(eng) -> list:
    """Every distinct communicator wrapper of the engine (mesh axes, the tied pair, the world)."""
    seen = {}
    for c in [*eng.mesh.comms.values(), eng.world]:
        if c is not None:
            seen.setdefault(id(c), c)
    return list(seen.values())


# A Tracer keeps per-category phase timers (always on: one perf_counter per
# phase) and, with `runtime.trace`, a bounded per-rank timeline of compact event tuples (compute per
# micro-batch, every MPI call with its communicator and bytes).
def attach(eng, cfg) -> Tracer:
    """A fresh tracer for the run (recording when runtime.trace), handed to the engine and its
    communicators; every rank's timeline starts at a barrier. Expert parallel's all-to-alls are timed even
    when not recording (a few calls per MoE layer, inside forward and backward): the breakdown shows them."""
    rt = cfg.runtime
    tr = Tracer(rt.trace, rt.trace_max_events)
    eng.attach_tracer(tr)
    for c in comms_of(eng):
        c.set_tracer(tr if rt.trace or c.name == "ep" else None)
    eng.world.c.Barrier()
    tr.t_zero = _now()
    return tr


# ---- clock alignment and the merged Chrome trace ----------------------------------------------------

def clock_offsets(c, rounds: int = 16):
    """Rank 0 gets, per rank, (offset_ns, error_ns) of that rank's perf_counter_ns clock against its own.
    On rank 0's host both read the same kernel clock (CLOCK_MONOTONIC): offset 0, error 0. Elsewhere,
    NTP-style ping-pong keeping the round with the shortest round trip: the true offset lies within
    +-error_ns, half that round trip (microseconds on a quiet network; more on oversubscribed cores).
    Other ranks get None."""
    rank, size = c.Get_rank(), c.Get_size()
    hosts = c.allgather(MPI.Get_processor_name())
    far = [r for r in range(1, size) if hosts[r] != hosts[0]]
    if rank != 0:
        for _ in range(rounds if rank in far else 0):
            c.recv(source=0, tag=CLOCK_TAG)
            c.send(_now(), dest=0, tag=CLOCK_TAG)
        return None
    out = [(0, 0)] * size
    for r in far:
        best = None
        for _ in range(rounds):
            ta = _now()
            c.send(None, dest=r, tag=CLOCK_TAG)
            tr = c.recv(source=r, tag=CLOCK_TAG)
            tb = _now()
            if best is None or (tb - ta) // 2 < best[1]:
                best = (tr - (ta + tb) // 2, (tb - ta) // 2)
        out[r] = best
    return out


def _name(cat, name, arg, virtual_stages: int) -> tuple[str, dict]:
    if isinstance(arg, tuple):                     # (micro-batch, global chunk) of F/B and recv waits
        mb, g = arg
        return f"{name}{mb}" + (f".c{g}" if virtual_stages > 1 else ""), {"micro_batch": mb, "chunk": g}
    if cat.startswith("comm:"):
        return name, {"bytes": arg, "comm": cat[5:]}
    return name, ({} if arg is None else {"step": arg} if cat == "step" else {"arg": arg})


def merge(parts: list, offsets: list, t_zero: int, virtual_stages: int = 1) -> dict:
    """One Chrome trace (JSON object format) from every rank's (rank, coords, events, dropped): pid = rank
    with its mesh coordinates as process name, tid = category (the same tid for a category on every rank),
    "X" complete events in microseconds from rank 0's start."""
    cats = ["step", *[c for c, _ in CATEGORIES]]
    for _, _, evs, _ in parts:
        cats += sorted({e[0] for e in evs} - set(cats))
    tid = {c: i + 1 for i, c in enumerate(cats)}
    out = []
    for rank, coords, evs, _ in parts:
        where = " ".join(f"{a}{coords[a]}" for a in ("dp", "sharding", "pp", "tp")).replace("sharding", "sh")
        out += [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} [{where}]"}},
                {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
        out += [m for c in sorted({e[0] for e in evs}, key=tid.get) for m in (
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid[c], "args": {"name": c}},
            {"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid[c], "args": {"sort_index": tid[c]}})]
        off = offsets[rank][0]
        for cat, name, t0, dur, arg in evs:
            n, args = _name(cat, name, arg, virtual_stages)
            out.append({"name": n, "cat": cat, "ph": "X", "pid": rank, "tid": tid[cat],
                        "ts": round((t0 - off - t_zero) / 1e3, 3), "dur": round(dur / 1e3, 3), "args": args})
    out.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0)))
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"clock": "perf_counter_ns (CLOCK_MONOTONIC) of each rank, shifted by its offset to rank "
                                   "0 (0 on rank 0's host, else ping-pong at the end of the run; error bound per "
                                   "rank in clock_error_us); ts = microseconds since rank 0's start",
                          "clock_error_us": [e / 1e3 for _, e in offsets],
                          "ranks": [{"rank": r, **c} for r, c, _, _ in parts],
                          "dropped_events": [d for *_, d in parts]}}


def write_trace(eng, tr: Tracer, path: Path) -> None:
    """Collective: align clocks, gather every rank's events to rank 0, write one Chrome trace."""
    w = eng.world.c
    offsets = clock_offsets(w)
    part = (eng.mesh.rank, dict(eng.mesh.coords), list(tr.events), tr.dropped)
    parts = w.gather(part, root=0)
    t_zero = w.bcast(tr.t_zero, root=0)
    if w.Get_rank() != 0:
        return
    doc = merge(parts, offsets, t_zero, eng.res.v)
    doc["otherData"]["max_events"] = tr.max_events
    write_file(path, json.dumps(doc, separators=(",", ":")), durable=False)
    dropped = sum(d for *_, d in parts)
    log.info("timeline: %d events from %d ranks -> %s%s (clock alignment error <= %.1f us)",
             sum(len(p[2]) for p in parts), len(parts), path,
             f"; {dropped} older events dropped (runtime.trace_max_events = {tr.max_events})" if dropped else "",
             max(e for _, e in offsets) / 1e3)


# ---- the end-of-run breakdown -------------------------------------------------------------------------

def model_flops(eng) -> tuple[float, str]:
    """Training FLOPs of one optimizer step (all models) and the formula used."""
    mc, tr = eng.cfg.model, eng.cfg.train
    moe = eng.slots[0].model.moe
    # a routed expert's weights multiply only the top_k / num_experts of the tokens that choose it
    active = (lambda name: moe.k / moe.E if ".moe.experts." in name else 1.0) if moe else (lambda name: 1.0)
    psi = sum(int(_prod(sp.true_shape or sp.global_shape)) * active(sp.name) for sp in reference_order_specs(eng.slots))
    tokens = tr.global_batch * mc.seq_len
    layers = sum(b.kind == "layer" for b in eng.slots[0].model.blocks())
    attn = 3 * eng.slots[0].model.attention_flops(tokens, 1) * layers    # forward + backward, whole model
    term, what = eng.slots[0].model.attention_flops_text()
    formula = (f"FLOPs/step = tokens x (6 x Psi + {term}) per model; Psi = parameters (tied head "
               f"counted once), tokens = global_batch x seq_len, {what}, "
               "forward + backward (none without attention); recomputation not counted"
               + ("; routed experts' weights count top_k / num_experts of themselves (the tokens each one sees)"
                  if moe else ""))
    return float(tokens * 6 * psi + attn * len(eng.slots)), formula


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def local_report(eng, tr: Tracer) -> dict:
    return {"rank": eng.mesh.rank, "coords": dict(eng.mesh.coords), "seconds": dict(tr.seconds),
            "memory": eng.memory(),
            "comm": {c.name: {"size": c.size, "ops": {op: list(v) for op, v in c.stats.items()}}
                     for c in comms_of(eng)}}


# The breakdown: time per category, bytes per communicator, memory
# per rank, achieved FLOP/s.
def breakdown(reports: list, wall: float, steps: int, step_s: float, flops_step: float, formula: str,
              comm_labels: dict) -> dict:
    """The breakdown from every rank's local_report (rank 0)."""
    n = len(reports)
    cats = [c for c, _ in CATEGORIES]
    times = {}
    for c, label in CATEGORIES:
        v = [r["seconds"].get(c, 0.0) for r in reports]
        times[c] = {"label": label.format(**comm_labels), "mean_s": sum(v) / n, "max_s": max(v), "per_rank": v}
    other = [wall - sum(r["seconds"].get(c, 0.0) for c in cats) for r in reports]
    times["other"] = {"label": "other (loop, logging, stop-signal check)", "mean_s": sum(other) / n,
                      "max_s": max(other), "per_rank": other}
    calls = {}
    for r in reports:
        for c, v in r["seconds"].items():
            if c.startswith("comm:"):
                calls.setdefault(c[5:], [0.0] * n)[r["rank"]] = v
    names = sorted({c for r in reports for c in r["comm"]})
    nbytes = {}
    for name in names:
        per_rank = [sum(b for _, b in r["comm"].get(name, {"ops": {}})["ops"].values()) for r in reports]
        ops = defaultdict(lambda: [0, 0])
        for r in reports:
            for op, (k, b) in r["comm"].get(name, {"ops": {}})["ops"].items():
                ops[op][0] += k
                ops[op][1] += b
        size = max(r["comm"].get(name, {"size": 1})["size"] for r in reports)
        nbytes[name] = {"size": size, "total": sum(per_rank), "per_step": sum(per_rank) / max(steps, 1),
                        "per_rank": per_rank, "ops": dict(ops)}
    achieved = flops_step * steps / step_s if step_s > 0 else 0.0
    return {"wall_s": wall, "steps": steps, "ranks": n, "time": times,
            "mpi_call_s": {k: {"mean_s": sum(v) / n, "max_s": max(v), "per_rank": v} for k, v in calls.items()},
            "bytes": nbytes,
            "memory": [{"rank": r["rank"], "coords": r["coords"], **r["memory"]} for r in reports],
            "flops": {"formula": formula, "per_step": flops_step, "train_step_s": step_s,
                      "achieved_flop_s": achieved, "per_rank_flop_s": achieved / n}}


def table(bd: dict) -> str:
    """The breakdown as text tables (what rank 0 logs)."""
    w = bd["wall_s"]
    lines = [f"end-of-run breakdown: {bd['steps']} steps, {bd['ranks']} ranks, {w:.2f} s wall",
             f"  {'time per category':<44} {'mean s':>9} {'max s':>9} {'% wall':>7}"]
    for c in [*[c for c, _ in CATEGORIES], "other"]:
        t = bd["time"][c]
        if t["max_s"] >= 5e-4 * w or c in ("forward", "backward"):   # hide what never happened
            lines.append(f"  {t['label']:<44} {t['mean_s']:>9.3f} {t['max_s']:>9.3f} {100 * t['mean_s'] / w:>6.1f}%")
    for name, t in sorted(bd["mpi_call_s"].items()):
        lines.append(f"  {'  incl. MPI calls on ' + name:<44} {t['mean_s']:>9.3f} {t['max_s']:>9.3f} "
                     f"{100 * t['mean_s'] / w:>6.1f}%")
    lines.append(f"  {'bytes per communicator':<22} {'size':>4} {'MiB/step':>10} {'MiB total':>10}  by op (calls, MiB)")
    if not any(b["total"] for b in bd["bytes"].values()):
        lines.append("  (none: nothing to communicate)")
    for name, b in bd["bytes"].items():
        if b["total"]:
            ops = ", ".join(f"{op} {k}x {v / 2**20:.2f}" for op, (k, v) in sorted(b["ops"].items()))
            lines.append(f"  {name:<22} {b['size']:>4} {b['per_step'] / 2**20:>10.3f} "
                         f"{b['total'] / 2**20:>10.2f}  {ops}")
    lines.append("  memory per rank (MiB)    params    grads optimizer activations transient  peak RSS")
    cp = any(m["coords"].get("cp", 0) for m in bd["memory"])        # named when context parallel is on
    for m in bd["memory"]:
        lines.append(f"  r{m['rank']:<4} pp{m['coords']['pp']} tp{m['coords']['tp']} dp{m['coords']['dp']} "
                     f"sh{m['coords']['sharding']} " + (f"cp{m['coords']['cp']} " if cp else "")
                     + " ".join(f"{m[k] / 2**20:>9.2f}" for k in (
                         "param_bytes", "grad_bytes", "optim_bytes", "activation_peak_bytes",
                         "transient_peak_bytes", "peak_rss_bytes")))
    f = bd["flops"]
    lines += [f"  achieved {f['achieved_flop_s'] / 1e9:.3f} GFLOP/s ({f['per_rank_flop_s'] / 1e9:.3f} per rank) "
              f"over {f['train_step_s']:.2f} s of train steps; {f['per_step'] / 1e9:.4f} GFLOP per step",
              f"  {f['formula']}"]
    return "\n".join(lines)


def comm_labels(eng) -> dict:
    names = eng.comm_names()
    return {"grads": ", ".join(names["grads"]) or "none", "params": ", ".join(names["params"]) or "none"}


def finish(eng, out, history: list, wall: float) -> dict | None:
    """Collective, at the end of train(): trace.json (when recording), then the breakdown, logged by
    rank 0 and written to breakdown.json. Returns the breakdown on rank 0, None elsewhere."""
    tr = eng.tracer
    for c in comms_of(eng):
        c.set_tracer(None)              # what follows is bookkeeping, not the run
    if tr.record:
        write_trace(eng, tr, Path(out) / "trace.json")
    reports = eng.world.c.gather(local_report(eng, tr), root=0)
    if eng.mesh.rank != 0:
        return None
    step_s = sum(m["step_ms"] for m in history) / 1e3
    flops, formula = model_flops(eng)
    bd = breakdown(reports, wall, len(history), step_s, flops, formula, comm_labels(eng))
    write_file(Path(out) / "breakdown.json", json.dumps(bd, indent=1), durable=False)
    log.info("%s", table(bd))
    return bd
