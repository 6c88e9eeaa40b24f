"""`hpengine plot RUN_A RUN_B --out DIR`: compare.png draws each run's validation and smoothed training loss,
labelled by folder; refusals are one line (no --out, no validation loss, two folders of one name)."""
from __future__ import annotations

import json

import pytest

from hpengine.apps.plot import PlotError, _pyplot, ema
from hpengine.apps.plot_compare import compare_figure, plot_compare
from hpengine.cli.commands import main


def write_run(folder, slope, val=True, batch=4, seq=8):
    folder.mkdir(parents=True)
    rows = []
    for s in range(10):
        r = {"step": s, "loss": 5.0 - slope * s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0}
        if val and s % 3 == 2:
            r["val_loss"] = 4.0 - slope * s
        rows.append(r)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.toml").write_text(f"[train]\nglobal_batch = {batch}\n[model]\nseq_len = {seq}\n")
    return rows


def test_compare_figure_draws_each_runs_losses_under_its_folder_name(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = write_run(tmp_path / "muon", 0.2), write_run(tmp_path / "adamw", 0.1)
    plt = _pyplot()
    fig = compare_figure(plt, [("muon", a, 32), ("adamw", b, 32)])
    val, train = [x for x in fig.axes if x.get_title()]
    assert [t.get_text() for t in val.get_legend().get_texts()] == ["muon", "adamw"]
    assert list(val.lines[0].get_xdata()) == [2, 5, 8]
    assert list(val.lines[1].get_ydata()) == pytest.approx([4.0 - 0.1 * s for s in (2, 5, 8)])
    assert list(train.lines[0].get_ydata()) == pytest.approx(ema([5.0 - 0.2 * s for s in range(10)]))
    assert [x.get_xlabel() for x in val.child_axes] == ["tokens (per model)"]
    plt.close(fig)
    fig = compare_figure(plt, [("muon", a, 32), ("adamw", b, 64)])        # tokens differ: no tokens axis
    assert [x for x in fig.axes if x.get_title()][0].child_axes == []
    plt.close(fig)


def test_plot_command_writes_compare_png_and_refuses_in_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "muon", 0.2)
    write_run(tmp_path / "adamw", 0.1)
    out = tmp_path / "cmp"
    assert main(["plot", str(tmp_path / "muon"), str(tmp_path / "adamw"), "--out", str(out)]) == 0
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "muon" / "plots").exists()          # nothing written into the runs
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "muon"), str(tmp_path / "adamw")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0]
    write_run(tmp_path / "x" / "muon", 0.3)
    with pytest.raises(PlotError, match="share a name"):
        plot_compare([tmp_path / "muon", tmp_path / "x" / "muon"], out)
    write_run(tmp_path / "a", 0.1, val=False)
    write_run(tmp_path / "b", 0.1, val=False)
    with pytest.raises(PlotError, match="eval_every"):
        plot_compare([tmp_path / "a", tmp_path / "b"], out)
