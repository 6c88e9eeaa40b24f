"""`hpengine train --resume auto` in one process: a fresh start in an empty folder, a bit-exact continuation
when the folder holds a checkpoint, a fresh start in place (earlier files kept) when it holds results but
no checkpoint, one clear line where auto makes no sense (no run folder, a complete run, a misspelt value),
and a stop signal during the last step is a finished run (exit 0), not an early stop (75). Saves by wall
time (checkpoint.every_minutes), and the line after a Ctrl-C that continues the run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpengine.run import launch
from hpengine.run import train as train_mod
from hpengine.cli.commands import main

TINY = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "train.global_batch=4", "runtime.backend='numpy'", "train.log_every=1000", "train.eval_every=0"]


def args(corpus, out, *extra) -> list[str]:
    res = []
    for item in [*TINY, f"data.path={corpus}", f"train.out_dir={out}", *extra]:
        res += ["--set", item]
    return res


def cli(capsys, *a) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["train", *[str(x) for x in a]])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpengine: error: "), err
    return lines[0]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_auto_starts_fresh_then_continues_bit_exactly(tmp_path, small_corpus, capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert cli(capsys, *args(small_corpus, straight, "train.steps=6"))[0] == 0
    rc, out, err = cli(capsys, *args(small_corpus, split, "train.steps=3"), "--resume", "auto")
    assert rc == 0, err
    assert f"--resume auto: no checkpoint under {split / 'checkpoints'} yet: starting from step 0" in out
    rc, out, err = cli(capsys, *args(small_corpus, split, "train.steps=6"), "--resume", "auto")
    assert rc == 0, err
    assert f"--resume auto: resuming from the latest checkpoint under {split / 'checkpoints'} (step 3)" in out
    assert summary(split)["final_loss"] == summary(straight)["final_loss"]
    losses = [[json.loads(x)["loss"] for x in (o / "metrics.jsonl").read_text().splitlines()] for o in (split, straight)]
    assert len(losses[0]) == 6 and losses[0] == losses[1]


def test_auto_refuses_an_empty_out_dir(tmp_path, small_corpus, capsys):
    rc, _, err = cli(capsys, *args(small_corpus, "", "train.steps=2"), "--resume", "auto")
    assert rc == 2
    assert "--resume auto: train.out_dir = '' is empty" in one_line(err)


def test_auto_starts_over_in_a_folder_without_a_checkpoint_keeping_the_earlier_files(tmp_path, small_corpus, capsys):
    out = tmp_path / "run"
    assert cli(capsys, *args(small_corpus, out, "train.steps=2", "checkpoint.at_end=false"))[0] == 0
    before = {n: (out / n).read_text() for n in ("metrics.jsonl", "config.toml")}
    rc, said, err = cli(capsys, *args(small_corpus, out, "train.steps=4"), "--resume", "auto")
    assert rc == 0, err
    assert f"'{out}' holds an earlier run but no checkpoint" in said and "starting over from step 0" in said
    # every file the earlier run wrote is kept aside (the new run writes each of them again)
    kept = {p.name.split(".before-")[0]: p for p in out.glob("*.before-*")}
    assert sorted(kept) == ["breakdown", "config", "launch", "metrics", "ranks", "summary", "tokenizer"]
    assert kept["config"].suffix == ".toml" and kept["metrics"].suffix == ".jsonl"
    assert [kept[k].read_text() for k in ("config", "metrics")] == [before["config.toml"], before["metrics.jsonl"]]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    fresh = tmp_path / "fresh"                   # the new run is a run from step 0: the same losses
    assert cli(capsys, *args(small_corpus, fresh, "train.steps=4"))[0] == 0
    assert (out / "metrics.jsonl").read_text().count("loss") == (fresh / "metrics.jsonl").read_text().count("loss")
    assert summary(out)["final_loss"] == summary(fresh)["final_loss"]


def test_auto_refuses_a_complete_run(tmp_path, small_corpus, capsys):
    out = tmp_path / "run"
    assert cli(capsys, *args(small_corpus, out, "train.steps=2"))[0] == 0
    rc, _, err = cli(capsys, *args(small_corpus, out, "train.steps=2"), "--resume", "auto")
    assert rc == 2
    assert f"the run in '{out}' is already complete" in one_line(err) and "train.steps = 2" in err


def test_a_misspelt_resume_value_names_the_valid_ones(tmp_path, small_corpus, capsys):
    rc, _, err = cli(capsys, *args(small_corpus, tmp_path / "run", "train.steps=2"), "--resume", "lastest")
    assert rc == 2
    line = one_line(err)
    assert "--resume 'lastest': the checkpoint folder does not exist" in line and "'latest'" in line and "'auto'" in line


@pytest.mark.parametrize("steps,code", [(1, 0), (3, 75)])
def test_a_stop_during_the_last_step_is_a_finished_run(tmp_path, small_corpus, capsys, monkeypatch, steps, code):
    """A stop signal seen after step 1: with 1 step the run is complete (0, requeueing would be wrong),
    with 3 steps it stopped early (75, resumable)."""
    monkeypatch.setattr(launch, "step_boundary", lambda comm=None, save_due=False, writer=0: ("SIGUSR1", False, 0))
    out = tmp_path / "run"
    rc, _, err = cli(capsys, *args(small_corpus, out, f"train.steps={steps}"))
    assert rc == code, err
    assert summary(out)["stopped_early"] == (None if code == 0 else "SIGUSR1")


def test_resume_latest_of_a_complete_run_is_one_line(tmp_path, small_corpus, capsys):
    out = tmp_path / "done"
    assert cli(capsys, *args(small_corpus, out, "train.steps=2"))[0] == 0
    rc, _, err = cli(capsys, *args(small_corpus, out, "train.steps=2"), "--resume", "latest")
    assert rc == 2 and "checkpoint is at step 2 and train.steps = 2: nothing to train" in one_line(err)


def test_every_minutes_saves_when_that_much_wall_time_has_passed(tmp_path, small_corpus, capsys, monkeypatch):
    """A clock that moves 25 s per step boundary, every_minutes = 1: a save after steps 3, 6, 9 (75 s since
    the last save each time; worked out by hand), then at_end after step 10."""
    saves = []          # each call of the clock is 25 s later: the loop reads it at the start, at each step
    monkeypatch.setattr(train_mod, "_clock", iter(range(0, 10_000, 25)).__next__)   # boundary and after a save
    monkeypatch.setattr(train_mod, "save_checkpoint", lambda eng, cfg, step, saver=None, after_write=None: saves.append(step))
    rc, _, err = cli(capsys, *args(small_corpus, tmp_path / "run", "train.steps=10", "checkpoint.every_minutes=1"))
    assert rc == 0, err
    assert saves == [3, 6, 9, 10]


def test_every_minutes_zero_is_off(tmp_path, small_corpus, capsys, monkeypatch):
    saves = []
    monkeypatch.setattr(train_mod, "_clock", iter(range(0, 10**9, 3600)).__next__)     # an hour a step
    monkeypatch.setattr(train_mod, "save_checkpoint", lambda eng, cfg, step, saver=None, after_write=None: saves.append(step))
    rc, _, err = cli(capsys, *args(small_corpus, tmp_path / "run", "train.steps=3", "checkpoint.every_minutes=0",
                                   "checkpoint.at_end=false"))
    assert rc == 0, err
    assert saves == []


def test_ctrl_c_ends_with_the_command_that_continues_the_run(tmp_path, small_corpus, capsys, monkeypatch):
    """Ctrl-C (the agreed stop) after step 1 of 4, before any save: the last line says how to go on, and
    that command starts over in the same folder, keeping the earlier metrics."""
    monkeypatch.setattr(launch, "step_boundary", lambda comm=None, save_due=False, writer=0: ("SIGINT", False, 0))
    out = tmp_path / "run"
    rc, said, err = cli(capsys, *args(small_corpus, out, "train.steps=4"))
    assert rc == 130, err
    last = said.strip().splitlines()[-1]
    want = f"continue with: hpengine train {out}/config.toml --resume auto"
    assert last.endswith(want), last
    monkeypatch.undo()
    rc, said, err = cli(capsys, *want.split()[4:5], *args(small_corpus, out), "--resume", "auto")
    assert rc == 0, err
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert len(list(out.glob("metrics.before-*.jsonl"))) == 1
