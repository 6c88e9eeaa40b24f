"""`hpengine plot RUN_A RUN_B ... --out DIR`: one PNG comparing runs — each run's validation loss and its
smoothed training loss against step, one colour per run, labelled by its folder name; a tokens axis on top
when every run took the same tokens per step.
"""
from __future__ import annotations

from pathlib import Path

from hpengine.apps.plot import PlotError, _by_model, _pyplot, ema, read_run, save


def compare_figure(plt, runs: list[tuple[str, list[dict], int]]):
    """Two panels against step: validation loss (points joined) and training loss (EMA), a line per run and
    model; runs: (label, metrics rows, tokens per step)."""
    fig, (ax_val, ax_train) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    colour = 0
    for label, rows, _ in runs:
        models = _by_model(rows)
        for model, rs in models.items():
            tag = label if len(models) == 1 else f"{label} (model {model})"
            x = [r["step"] for r in rs]
            val = [(xx, r["val_loss"]) for xx, r in zip(x, rs) if "val_loss" in r]
            if val:
                ax_val.plot(*zip(*val), "o-", ms=3, lw=1.4, color=f"C{colour}", label=tag)
            ax_train.plot(x, ema([r["loss"] for r in rs]), lw=1.4, color=f"C{colour}", label=tag)
            colour += 1
    ax_val.set_title("validation loss")
    ax_train.set_title("training loss (EMA)")
    ax_train.set_xlabel("step")
    tokens = {t for _, _, t in runs}
    if len(tokens) == 1 and 0 not in tokens:
        t = tokens.pop()
        top = ax_val.secondary_xaxis("top", functions=(lambda s: s * t, lambda k: k / t))
        top.set_xlabel("tokens (per model)")
    for a in (ax_val, ax_train):
        a.set_ylabel("loss")
        a.grid(alpha=0.3)
        if a.lines:
            a.legend()
    fig.tight_layout()
    return fig


def plot_compare(run_dirs, out_dir) -> Path:
    """Write compare.png into out_dir for the runs in run_dirs (at least two); returns its path."""
    if out_dir is None:
        raise PlotError("comparing runs needs --out DIR, the folder where compare.png goes (no run folder is "
                        "written into)")
    labels = [Path(r).resolve().name for r in run_dirs]
    if len(set(labels)) != len(labels):
        raise PlotError(f"runs {', '.join(map(str, run_dirs))}: two folders share a name, which labels the "
                        f"curves; give runs in folders of different names")
    runs = [(label, *read_run(Path(r))) for label, r in zip(labels, run_dirs)]
    if not any("val_loss" in row for _, rows, _ in runs for row in rows):
        raise PlotError("no run logged a validation loss; train with train.eval_every > 0 to compare them")
    plt = _pyplot()
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlotError(f"plot: cannot write '{out}': {exc.strerror or exc}") from None
    return save(plt, compare_figure(plt, runs), out / "compare.png")
