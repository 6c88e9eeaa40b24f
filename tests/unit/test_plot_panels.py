"""`hpengine plot`'s loss figure: one loss panel (raw faint under its moving average, validation points, a
tokens axis on top), a learning-rate panel and a gradient-norm panel; each curve drawn once."""
from __future__ import annotations

import pytest

from hpengine.apps.plot import _pyplot, ema, loss_figure


def metrics(models=1, steps=12):
    rows = []
    for s in range(steps):
        for m in range(models):
            r = {"step": s, "loss": 5.0 - 0.1 * s + 0.3 * (s % 2) + m, "lr": 1e-3 * (s + 1), "grad_norm": 2.0 / (s + 1),
                 "tokens_per_s": 1e4}
            if s % 4 == 3:
                r["val_loss"] = 4.5 - 0.1 * s
            rows.append(r if models == 1 else {**r, "model": m})
    return rows


def test_ema_is_debiased_and_smooths():
    assert ema([3.0, 3.0, 3.0]) == pytest.approx([3.0, 3.0, 3.0])
    x = [0.0, 10.0] * 20
    s = ema(x)
    assert s[0] == 0.0 and max(s[10:]) - min(s[10:]) < 0.5 * (max(x) - min(x))


def test_loss_figure_has_three_titled_panels_and_each_curve_once():
    pytest.importorskip("matplotlib")
    plt = _pyplot()
    fig = loss_figure(plt, metrics(), tokens=32)
    main = [a for a in fig.axes if a.get_title()]
    assert [a.get_title() for a in main] == ["loss", "learning rate", "gradient norm (before clipping)"]
    loss, lr, gn = main
    assert len(loss.lines) == 3                  # raw, EMA, validation
    raw, smooth, val = loss.lines
    assert raw.get_alpha() < 0.5 and smooth.get_alpha() in (None, 1.0)
    assert list(raw.get_ydata()) == [r["loss"] for r in metrics()]
    assert list(smooth.get_ydata()) == pytest.approx(ema(list(raw.get_ydata())))
    assert len(val.get_xdata()) == 3
    assert len(lr.lines) == 1 and len(gn.lines) == 1 and gn.get_yscale() == "log"
    assert gn.get_xlabel() == "step" and lr.get_ylabel() == "lr"
    assert len(fig.axes) == 3
    assert [a.get_xlabel() for a in loss.child_axes] == ["tokens (per model)"]     # the axis on top
    plt.close(fig)


def test_several_models_get_one_raw_and_one_smoothed_curve_each():
    pytest.importorskip("matplotlib")
    plt = _pyplot()
    fig = loss_figure(plt, metrics(models=2), tokens=0)
    loss, lr, gn = fig.axes
    assert loss.child_axes == []                  # no tokens axis without config.toml's batch and seq_len
    assert len(loss.lines) == 6 and len(lr.lines) == 2 and len(gn.lines) == 2
    assert sorted(t.get_text() for t in loss.get_legend().get_texts()) == sorted(
        f"{k} (model {m})" for m in (0, 1) for k in ("train (raw)", "train (EMA 0.9)", "validation"))
    plt.close(fig)


def test_outer_steps_and_a_survived_death_are_marked():
    pytest.importorskip("matplotlib")
    plt = _pyplot()
    rows = metrics()
    for r in rows[4::4]:                     # DiLoCo's outer steps land after steps 4 and 8
        r.update(outer_step=r["step"] // 4, outer_grad_norm=0.1)
    rows[6].update(dead_ranks=[1], recovery_s=0.42, spare_ranks=[4])
    rows[10].update(dead_ranks=[2, 3], recovery_s=1.5, shrunk="dp 4 -> 3")
    fig = loss_figure(plt, rows, tokens=0)
    loss, lr, gn = fig.axes
    marks = [ln for ln in loss.lines if ln.get_label() == "DiLoCo outer step"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [4, 8]
    assert list(marks[0].get_ydata()) == pytest.approx([ema([r["loss"] for r in rows])[i] for i in (4, 8)])
    for a in (loss, lr, gn):                 # one vertical line per survived death, in every panel
        assert [ln.get_xdata()[0] for ln in a.lines if ln.get_linestyle() == ":"] == [6, 10]
    labels = [t.get_text() for t in loss.get_legend().get_texts()]
    assert "rank 1 died; spare took over (0.42 s)" in labels and "rank 2, 3 died; shrunk dp 4 -> 3 (1.50 s)" in labels
    plt.close(fig)
