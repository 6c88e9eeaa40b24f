"""`hpengine plot RUN_DIR`: PNGs of a run folder — loss.png: the training loss (raw, faint, under its
moving average) and validation loss against step (tokens on the top axis), the learning rate and the
gradient norm; throughput; the pipeline Gantt chart (stages x time, per micro-batch) from trace.json.
"""
from __future__ import annotations

import io
import json
import os
import statistics
import tomllib
from pathlib import Path

from hpengine.files.safe import write_file

TRACE_SWITCH = "--set runtime.trace=true (runtime.trace = true in the config)"


class PlotError(ValueError):
    """A run folder that cannot be plotted, or matplotlib missing; one clear line."""


def read_run(run: Path) -> tuple[list[dict], int]:
    """metrics.jsonl lines and tokens per step (per model), with clear errors for what is missing."""
    if not run.is_dir():
        raise PlotError(f"'{run}' is not a folder; give the run folder of a training run (its train.out_dir)")
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        raise PlotError(f"'{run}' is not a run folder: it has no metrics.jsonl (`hpengine train` writes one into "
                        f"train.out_dir)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        raise PlotError(f"'{metrics}' holds no steps yet; plot again once the run has logged a step")
    tokens = 0
    if (run / "config.toml").exists():
        t = tomllib.loads((run / "config.toml").read_text())
        tokens = t.get("train", {}).get("global_batch", 0) * t.get("model", {}).get("seq_len", 0)
    return rows, tokens


def had_pipeline(run: Path) -> bool:
    """Whether the run folder's config.toml turned the pipeline on (true when it cannot be read: the Gantt
    chart's note then still says how to get one)."""
    try:
        t = tomllib.loads((run / "config.toml").read_text())
    except (OSError, ValueError):
        return True
    return bool(t.get("strategy", {}).get("pipeline", {}).get("enable", False))


# matplotlib is an optional extra (`pip install 'hpengine[plot]'`).
def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("hpengine plot needs matplotlib, which is not installed: pip install 'hpengine[plot]' "
                        "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_run(run_dir, out_dir=None) -> tuple[list[Path], list[str]]:
    """Write the PNGs of one run folder; returns (files written, notes on what could not be drawn)."""
    run = Path(run_dir)
    rows, tokens = read_run(run)
    plt = _pyplot()
    out = Path(out_dir) if out_dir else run / "plots"
    if not out_dir and os.path.islink(out):     # the run's own folder: a link there leads the PNGs elsewhere
        raise PlotError(f"'{out}' is a symbolic link, not the run's plots folder: remove it, or pass --out DIR "
                        "to choose where the PNGs go")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlotError(f"plot: cannot write '{out}': {exc.strerror or exc}") from None
    written = [plot_loss(plt, rows, tokens, out / "loss.png"), plot_throughput(plt, rows, out / "throughput.png")]
    notes = []
    trace, pipeline = run / "trace.json", had_pipeline(run)     # a run without a pipeline needs no Gantt note
    if not trace.exists():
        if pipeline:
            notes.append(f"no trace.json in '{run}': the pipeline Gantt chart is drawn from a timeline; record one "
                         f"with {TRACE_SWITCH}")
    else:
        try:
            doc = json.loads(trace.read_text())
            events = doc["traceEvents"]
        except (ValueError, KeyError) as exc:
            raise PlotError(f"'{trace}' is not a Chrome trace written by hpengine ({exc})") from None
        g = plot_gantt(plt, events, doc.get("otherData", {}).get("ranks", []), out / "pipeline_gantt.png")
        if g is not None:
            written.append(g)
        elif pipeline:
            notes.append(f"'{trace}' holds no forward/backward events (its oldest events may have been dropped; "
                         f"raise runtime.trace_max_events)")
    return written, notes


def _by_model(rows):
    models = {}
    for r in rows:
        models.setdefault(r.get("model", 0), []).append(r)
    return models


SMOOTHING = 0.9      # EMA weight of the smoothed loss (debiased, as TensorBoard's smoothing)


def ema(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased exponential moving average: s_t = w s_(t-1) + (1 - w) x_t, divided by 1 - w^t."""
    out, s = [], 0.0
    for t, v in enumerate(values, 1):
        s = weight * s + (1 - weight) * v
        out.append(s / (1 - weight ** t))
    return out


def loss_figure(plt, rows, tokens):
    """Three panels against step: the loss (raw faint, its EMA over it, validation points, DiLoCo's outer steps),
    the learning rate and the gradient norm; a tokens axis on top of the loss panel when tokens per step are
    known; a dotted red line where a rank died and the job went on (resilience)."""
    fig, (ax, ax_lr, ax_gn) = plt.subplots(3, 1, figsize=(9, 9), sharex=True, height_ratios=(2, 1, 1))
    models = _by_model(rows)
    for i, (model, rs) in enumerate(models.items()):
        tag = "" if len(models) == 1 else f" (model {model})"
        colour = f"C{i}"
        x = [r["step"] for r in rs]
        loss = [r["loss"] for r in rs]
        ax.plot(x, loss, lw=0.8, alpha=0.3, color=colour, label="train (raw)" + tag)
        ax.plot(x, ema(loss), lw=1.6, color=colour, label=f"train (EMA {SMOOTHING})" + tag)
        val = [(xx, r["val_loss"]) for xx, r in zip(x, rs) if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), "o--", ms=4, lw=1, color=colour, mfc="white", label="validation" + tag)
        outer = [(xx, y) for xx, y, r in zip(x, ema(loss), rs) if "outer_grad_norm" in r]
        if outer:           # DiLoCo: the steps after which the islands met, on the smoothed curve
            ax.plot(*zip(*outer), "^", ms=5, color="black", label="DiLoCo outer step" + tag)
        ax_lr.plot(x, [r["lr"] for r in rs], lw=1.2, color=colour, label="lr" + tag)
        ax_gn.plot(x, [r["grad_norm"] for r in rs], lw=1.0, color=colour, label="grad norm" + tag)
    for r in rows:          # a rank's death the job survived: at the first step completed after it
        if "dead_ranks" in r:
            how = ("spare took over" if "shrunk" not in r else f"shrunk {r['shrunk']}")
            for i, a in enumerate((ax, ax_lr, ax_gn)):
                a.axvline(r["step"], color="red", ls=":", lw=1.2, label=None if i else (
                    f"rank {', '.join(map(str, r['dead_ranks']))} died; {how} ({r.get('recovery_s', 0):.2f} s)"))
    ax.set_title("loss")
    ax.set_ylabel("loss")
    ax.legend()
    if tokens:
        top = ax.secondary_xaxis("top", functions=(lambda s: s * tokens, lambda t: t / tokens))
        top.set_xlabel("tokens (per model)")
    ax_lr.set_title("learning rate")
    ax_lr.set_ylabel("lr")
    ax_gn.set_title("gradient norm (before clipping)")
    ax_gn.set_ylabel("global grad norm")
    if all(r["grad_norm"] > 0 for r in rows):
        ax_gn.set_yscale("log")
    ax_gn.set_xlabel("step")
    for a in (ax, ax_lr, ax_gn):
        a.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# Each PNG is drawn in memory and written by
# write_file (a fresh temporary file renamed onto it): a link where a PNG goes is replaced, never written through.
def save(plt, fig, path: Path) -> Path:
    """The figure as a PNG at path (drawn in memory, then write_file); closes the figure."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110)
    finally:
        plt.close(fig)
    try:
        write_file(path, buf.getvalue())
    except OSError as exc:
        raise PlotError(f"plot: cannot write '{path}': {exc.strerror or exc}") from None
    return path


def plot_loss(plt, rows, tokens, path: Path) -> Path:
    return save(plt, loss_figure(plt, rows, tokens), path)


def plot_throughput(plt, rows, path: Path) -> Path:
    rs = _by_model(rows)[rows[0].get("model", 0)]
    steps, tps = [r["step"] for r in rs], [r["tokens_per_s"] for r in rs]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, tps, lw=1.2, label="tokens/s (all models)")
    med = statistics.median(tps[1:] or tps)
    ax.axhline(med, ls="--", color="grey", label=f"median {med:,.0f} tokens/s")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("throughput")
    fig.tight_layout()
    return save(plt, fig, path)


def gantt_window(events) -> tuple[float, float, str]:
    """The time window of the last training step recorded on every rank (all events if none)."""
    steps = {}
    for e in events:
        if e.get("cat") == "step" and e["ph"] == "X":
            s = e["args"].get("step")
            lo, hi = steps.get(s, (float("inf"), float("-inf")))
            steps[s] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
    if steps:
        last = max(steps)
        return (*steps[last], f"step {last}")
    xs = [e for e in events if e["ph"] == "X"]
    return min(e["ts"] for e in xs), max(e["ts"] + e["dur"] for e in xs), "whole trace"


def plot_gantt(plt, events, ranks, path: Path, max_rows: int = 16):
    """Stages x time for the last step: F (light), B (dark) and, under a zero-bubble schedule, W (dark,
    hatched) bars per micro-batch (colour), recv waits grey. One row per rank (grouped by pipeline stage);
    with many ranks, one rank per stage."""
    fb = [e for e in events if e["ph"] == "X" and e.get("cat") in ("forward", "backward", "weights", "pipeline idle")]
    if not any(e["cat"] != "pipeline idle" for e in fb):
        return None
    lo, hi, what = gantt_window(events)
    coords = {r["rank"]: r for r in ranks} or {p: {"pp": 0} for p in {e["pid"] for e in fb}}
    rows = sorted(coords, key=lambda r: (coords[r].get("pp", 0), r))
    if len(rows) > max_rows:
        first = {}
        for r in rows:
            first.setdefault(coords[r].get("pp", 0), r)
        rows = sorted(first.values(), key=lambda r: coords[r].get("pp", 0))
    y = {r: i for i, r in enumerate(rows)}
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.8))
    for e in fb:
        if e["pid"] not in y or e["ts"] + e["dur"] < lo or e["ts"] > hi:
            continue
        x0, w = (e["ts"] - lo) / 1e3, e["dur"] / 1e3
        mb = e["args"].get("micro_batch", 0)
        if e["cat"] == "pipeline idle":
            ax.broken_barh([(x0, w)], (y[e["pid"]] - 0.15, 0.3), color="0.75")
            continue
        colour = cmap((2 * mb) % 20 + (1 if e["cat"] == "forward" else 0))
        ax.broken_barh([(x0, w)], (y[e["pid"]] - 0.4, 0.8), facecolor=colour, edgecolor="black", lw=0.4,
                       hatch="//" if e["cat"] == "weights" else None)
        if w > (hi - lo) / 1e3 / 60:
            ax.text(x0 + w / 2, y[e["pid"]], e["name"], ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"stage {coords[r].get('pp', 0)} (r{r})" for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel(f"ms since the start of {what}")
    kind = "pipeline" if any(coords[r].get("pp", 0) for r in rows) else "no pipeline"
    split = any(e["cat"] == "weights" for e in fb)
    ax.set_title(f"{kind}, {what}: forward (light) / backward (dark)" + (" / weight gradients (hatched)" if split else "")
                 + " per micro-batch (colour), recv waits (grey)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return save(plt, fig, path)
