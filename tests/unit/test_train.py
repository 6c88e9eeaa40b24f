"""End-to-end tests of the one-process training loop and of the command line: a short run learns and
writes its run folder; bad input of every kind ends with exit status 2 and one clear stderr line."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.data import TokenDataset, TokenFile
from hpengine.engine.engine import NonFiniteError
from hpengine.optim import clip_coefficient, lr_at
from hpengine.run.train import train

TINY = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2",
        "model.n_heads=2", "train.global_batch=4", "runtime.backend='numpy'"]
KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "mfu", "elapsed_s", "eta_s", "mem_bytes"}


def tiny(data, out, *extra):
    return TINY + [f"data.path={data}", f"train.out_dir={out}", *extra]


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- (a) a short run learns

def test_short_run_learns_and_writes_its_run_folder(tmp_path, small_corpus):
    out = tmp_path / "run"
    cfg = load_config(None, tiny(small_corpus, out, "model.dtype='float32'", "optim.lr=3e-3",
                                 "optim.warmup_steps=5", "optim.schedule='constant'", "train.steps=60",
                                 "train.eval_every=20", "train.log_every=10"))
    summary = train(cfg)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 61))     # optimizer steps completed, from 1
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000060"   # the same numbering
    for r in rows:
        evaluated = r["step"] % 20 == 0
        assert set(r) == KEYS | ({"val_loss"} if evaluated else set()), r
        assert all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) for k in r
                   if r[k] is not None or k not in ("mfu", "eta_s"))      # null: no trusted peak; step 1's ETA
        assert r["mfu"] is None or 0 < r["mfu"] <= 1
        # lr 3e-3, warm-up 5 then constant: steps 1..5 -> 3e-3 * step / 5, then 3e-3
        assert r["lr"] == pytest.approx(3e-3 * min(r["step"], 5) / 5, rel=1e-12)
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["step_ms"] > 0
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert abs(first - math.log(256)) < 0.3
    assert last < 0.7 * first, f"loss {first:.3f} -> {last:.3f}: the model did not learn"
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0] < first
    assert summary["first_loss"] == first and summary["final_loss"] == last
    assert summary["final_val_loss"] == vals[-1] and summary["steps"] == 60
    # the resolved config is in the run folder and reads back to the same Config
    assert load_config(out / "config.toml") == cfg


# ---------------------------------------------------------------- (a2) schedule and clipping, by hand

def optim(**kw):
    """An [optim] section: lr 1e-3, 10 warm-up steps, floor = min_lr_ratio 0.1 x lr = 1e-4."""
    sets = {"lr": 1e-3, "warmup_steps": 10, "min_lr_ratio": 0.1, "schedule": "'cosine'", **kw}
    return load_config(None, [f"optim.{k}={v}" for k, v in sets.items()]).optim


# warm-up: lr * (step + 1) / warmup for step < warmup, so the first step already trains at lr/warmup
# and the last warm-up step reaches lr; the same for every schedule
@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("step,want", [
    (0, 1e-4),     # 1e-3 * 1 / 10
    (4, 5e-4),     # 1e-3 * 5 / 10
    (9, 1e-3),     # 1e-3 * 10 / 10
])
def test_lr_warmup_by_hand(schedule, step, want):
    assert lr_at(step, optim(schedule=f"'{schedule}'"), 110) == pytest.approx(want, rel=1e-12, abs=0)


# after warm-up, with total 110 steps: frac = (step - 10) / (110 - 10), clamped to 1;
# cosine: 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + cos(pi * frac)); linear: 1e-4 + (1e-3 - 1e-4) * (1 - frac)
@pytest.mark.parametrize("step,cosine,linear", [
    (10, 1e-3, 1e-3),                                   # frac 0: the peak
    (35, 8.681980515339464e-4, 7.75e-4),                # frac 0.25: 1e-4 + 9e-4 * 0.5 * (1 + cos(pi/4))
                                                        #   = 1e-4 + 9e-4 * 0.8535533905932737; 1e-4 + 9e-4 * 0.75
    (60, 5.5e-4, 5.5e-4),                               # frac 0.5: 1e-4 + 9e-4 * 0.5 (cos(pi/2) = 0)
    (85, 2.318019484660536e-4, 3.25e-4),                # frac 0.75: 1e-4 + 9e-4 * 0.1464466094067262; * 0.25
    (109, None, 1.09e-4),                               # the last step of a 110-step run: frac 0.99,
                                                        #   1e-4 + 9e-4 * 0.01 (the floor is not reached)
    (110, 1e-4, 1e-4),                                  # frac 1: the floor, min_lr_ratio * lr
    (500, 1e-4, 1e-4),                                  # past the end: frac clamped to 1, stays at the floor
])
def test_lr_decay_by_hand(step, cosine, linear):
    if cosine is not None:
        assert lr_at(step, optim(schedule="'cosine'"), 110) == pytest.approx(cosine, rel=1e-12, abs=0)
    assert lr_at(step, optim(schedule="'linear'"), 110) == pytest.approx(linear, rel=1e-12, abs=0)


def test_lr_constant_no_warmup_and_zero_floor_by_hand():
    assert lr_at(50, optim(schedule="'constant'"), 110) == 1e-3            # constant after warm-up
    assert lr_at(0, optim(warmup_steps=0), 100) == 1e-3                    # no warm-up: the peak at step 0
    assert lr_at(50, optim(warmup_steps=0), 100) == pytest.approx(5.5e-4, rel=1e-12)  # frac 0.5 of 100
    # min_lr_ratio 0: cosine ends at 0; halfway (frac 0.5) is 1e-3 * 0.5 = 5e-4
    assert lr_at(110, optim(min_lr_ratio=0), 110) == 0.0
    assert lr_at(60, optim(min_lr_ratio=0), 110) == pytest.approx(5e-4, rel=1e-12)
    # lr 0 trains nothing at every step
    assert {lr_at(s, optim(lr=0), 110) for s in (0, 9, 10, 60, 110)} == {0.0}


@pytest.mark.parametrize("norm,limit,want", [
    (0.5, 1.0, 1.0),                     # below the limit: untouched
    (1.0, 1.0, 1.0),                     # at the limit: untouched
    (4.0, 1.0, 0.24999993750001562),     # above: 1 / (4 + 1e-6), the 1e-6 guard of torch's clip_grad_norm_
    (2.0, 0.5, 0.2499998750000625),      # 0.5 / (2 + 1e-6)
    (1e9, 0.0, 1.0),                     # limit 0 = clipping off, whatever the norm
    (0.0, 1.0, 1.0),                     # a zero gradient is never scaled (no division by zero)
])
def test_clip_coefficient_by_hand(norm, limit, want):
    assert clip_coefficient(norm, limit) == pytest.approx(want, rel=1e-15, abs=0)


# ---------------------------------------------------------------- (b) bad input through the CLI

def only_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected exactly one stderr line, got:\n{err}"
    assert lines[0].startswith("hpengine: error: "), lines[0]
    return lines[0]


def run_cli(args, capsys) -> str:
    code = main(args)
    msg = only_error_line(capsys)
    assert code == 2, msg
    return msg


def no_results(out: Path) -> bool:
    return not (out / "metrics.jsonl").exists() and not (out / "config.toml").exists()


def train_args(tmp_path, data, *extra):
    out = tmp_path / "run"
    args = ["train"]
    for item in tiny(data, out, "train.steps=2", "train.eval_every=0", *extra):
        args += ["--set", item]
    return args, out


def test_missing_data_file(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "tokens.h5"
    args, out = train_args(tmp_path, missing)
    msg = run_cli(args, capsys)
    assert str(missing) in msg and "not found" in msg
    assert no_results(out)


def test_hdf5_without_tokens(tmp_path, capsys):
    path = tmp_path / "ids.h5"
    with h5py.File(path, "w") as h5:
        h5["ids"] = np.arange(100, dtype=np.uint8)
    args, out = train_args(tmp_path, path)
    msg = run_cli(args, capsys)
    assert str(path) in msg and "'tokens'" in msg and "ids" in msg
    assert no_results(out)


def test_token_ids_beyond_vocab(tmp_path, capsys):
    path = tmp_path / "bytes.h5"
    with h5py.File(path, "w") as h5:   # no vocab_size attribute: the token values themselves are checked
        h5["tokens"] = (np.arange(5000) % 200).astype(np.uint8)
    args, out = train_args(tmp_path, path, "model.vocab_size=64")
    msg = run_cli(args, capsys)
    assert str(path) in msg and "199" in msg and "model.vocab_size = 64" in msg
    assert no_results(out)


def test_corpus_built_for_a_larger_vocab(tmp_path, capsys, small_corpus):
    args, out = train_args(tmp_path, small_corpus, "model.vocab_size=64")
    msg = run_cli(args, capsys)
    assert str(small_corpus) in msg and "vocab_size" in msg and "64" in msg
    assert no_results(out)


def test_toml_syntax_error(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nd_model = 16\n[train\nsteps = 2\n")
    msg = run_cli(["train", str(bad)], capsys)
    assert str(bad) in msg and "line 3" in msg


def test_config_file_not_found(tmp_path, capsys):
    missing = tmp_path / "missing.toml"
    msg = run_cli(["train", str(missing)], capsys)
    assert str(missing) in msg


def test_negative_lr(tmp_path, capsys, small_corpus):
    args, out = train_args(tmp_path, small_corpus, "optim.lr=-0.001")
    msg = run_cli(args, capsys)
    assert "optim.lr" in msg and "-0.001" in msg and ">= 0" in msg
    assert not out.exists()


def test_seq_len_longer_than_the_data(tmp_path, capsys):
    path = tmp_path / "short.h5"
    with h5py.File(path, "w") as h5:
        h5["tokens"] = np.arange(60, dtype=np.uint8)
    args, out = train_args(tmp_path, path, "model.seq_len=64")
    msg = run_cli(args, capsys)
    assert str(path) in msg and "seq_len" in msg
    assert no_results(out)


@pytest.mark.parametrize("item,key", [("model.d_modle=16", "model.d_modle"),
                                      ("optim.learning_rate=1", "optim.learning_rate"),
                                      ("strategy.zero.enable=true", "strategy.zero")])
def test_unknown_key_on_the_command_line(tmp_path, capsys, small_corpus, item, key):
    args, out = train_args(tmp_path, small_corpus, item)
    msg = run_cli(args, capsys)
    assert f"'{key}'" in msg and "unknown key" in msg
    assert not out.exists()


def test_unknown_key_in_the_file(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nsteps = 2\nbatch = 4\n")
    msg = run_cli(["train", str(cfg)], capsys)
    assert str(cfg) in msg and "'train.batch'" in msg and "global_batch" in msg


@pytest.mark.parametrize("extra,key", [
    (["strategy.amp.enable=true", "strategy.amp.grad_dtype='bfloat16'"], "strategy.amp.grad_dtype"),
    (["strategy.amp.enable=true", "model.dtype='float64'"], "model.dtype"),
    (["strategy.recompute.enable=true", "strategy.recompute.every=3"], "strategy.recompute.every"),
    (["strategy.gradient_merge.enable=true", "strategy.gradient_merge.k_steps=3"], "k_steps"),
    (["strategy.gradient_merge.k_steps=0"], "strategy.gradient_merge.k_steps"),
    (["strategy.amp.init_scale=0"], "strategy.amp.init_scale"),
])
def test_strategy_settings_that_cannot_run(tmp_path, capsys, small_corpus, extra, key):
    args, out = train_args(tmp_path, small_corpus, *extra)
    msg = run_cli(args, capsys)
    assert key in msg
    assert not (out / "metrics.jsonl").exists()


def test_resume_from_a_missing_checkpoint(tmp_path, capsys, small_corpus):
    args, out = train_args(tmp_path, small_corpus)
    msg = run_cli(args + ["--resume", str(tmp_path / "no-such-checkpoint")], capsys)
    assert "--resume" in msg
    assert no_results(out)


# ---------------------------------------------------------------- (c) the run folder is protected

def test_run_folder_with_results_is_refused_and_left_alone(tmp_path, capsys, small_corpus):
    args, out = train_args(tmp_path, small_corpus)
    assert main(args) == 0
    capsys.readouterr()
    metrics, config = (out / "metrics.jsonl").read_bytes(), (out / "config.toml").read_bytes()
    assert len(metrics.splitlines()) == 2
    again = args + ["--set", "train.steps=3"]
    msg = run_cli(again, capsys)
    assert str(out) in msg and "train.out_dir" in msg
    assert (out / "metrics.jsonl").read_bytes() == metrics
    assert (out / "config.toml").read_bytes() == config


def test_existing_empty_folder_is_accepted(tmp_path, capsys, small_corpus):
    args, out = train_args(tmp_path, small_corpus)
    out.mkdir()
    assert main(args) == 0
    assert capsys.readouterr().err == ""
    assert len(read_metrics(out)) == 2


# ---------------------------------------------------------------- (d) data build

def test_data_build_writes_a_loadable_file(tmp_path, capsys):
    src = tmp_path / "texts"
    (src / "sub").mkdir(parents=True)
    (src / "one.txt").write_bytes(b"first file " * 20)
    (src / "sub" / "two.py").write_bytes(b"x = 1\n" * 30)
    out = tmp_path / "built" / "X.h5"
    assert main(["data", "build", "--out", str(out), str(src)]) == 0
    io = capsys.readouterr()
    assert io.err == "" and str(out) in io.out and "2 files" in io.out
    # each file one document, each document followed by the bytes tokenizer's end-of-document 0
    with TokenFile(out) as f:
        assert f.read(0, f.n_tokens).tobytes() == b"first file " * 20 + b"\0" + b"x = 1\n" * 30 + b"\0"
        assert list(f.doc_offsets) == [0, 221, 402]
    ds = TokenDataset(out, seq_len=8, vocab_size=256, val_fraction=0.1)
    b = ds.batch("train", 0, 1, 4)
    assert b.tokens.shape == b.targets.shape == (4, 8)


def test_data_build_missing_source(tmp_path, capsys):
    out = tmp_path / "X.h5"
    msg = run_cli(["data", "build", "--out", str(out), str(tmp_path / "absent")], capsys)
    assert "absent" in msg and not out.exists()


# ---------------------------------------------------------------- (e) the console script

def console_script() -> Path:
    exe = Path(sys.executable).parent / "hpengine"
    if not exe.exists():
        pytest.skip(f"no console script next to {sys.executable} (package not installed?)")
    return exe


def run_script(args, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HPENGINE_CACHE=str(tmp_path / "cache"))
    return subprocess.run([str(console_script()), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


def test_console_script_trains(tmp_path, small_corpus):
    args, out = train_args(tmp_path, small_corpus)
    res = run_script(args, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert "step" in res.stdout and "loss" in res.stdout


def test_console_script_exit_status_on_bad_config(tmp_path, small_corpus):
    args, out = train_args(tmp_path, small_corpus, "optim.lr=-1")
    res = run_script(args, tmp_path)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [res.stderr.strip()] and res.stderr.startswith("hpengine: error: ")
    assert "optim.lr" in res.stderr


def test_a_diverging_run_stops_on_one_line_without_numpy_warnings(tmp_path, small_corpus, capfd):
    """optim.lr = 1e5 overflows within a few steps: NumPy's RuntimeWarnings (overflow, invalid) would print
    before the engine's one-line non-finite report; none is raised, in the step or in the evaluation."""
    cfg = load_config(None, tiny(small_corpus, tmp_path / "run", "optim.lr=1e5", "train.steps=8",
                                 "train.eval_every=1"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")             # every warning reaches `seen`, none is deduplicated away
        with pytest.raises(NonFiniteError, match="non-finite loss or gradient"):
            train(cfg)
    assert [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)] == []
    assert "RuntimeWarning" not in capfd.readouterr().err
