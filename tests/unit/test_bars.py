"""Progress on the long commands (eval, generate, ckpt export, data build): a bar on standard error where a
person watches (a real pseudo-terminal, rank 0), nothing but the summary line when redirected to a file."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading

import pytest

from hpengine.cli.commands import main
from hpengine.files import bars

TINY = ["model.dtype=float64", "model.seq_len=16", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "train.steps=2", "train.global_batch=4", "train.eval_every=0", "runtime.backend=numpy", "train.log_every=1"]


@pytest.fixture(scope="module")
def run(small_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bars") / "run"
    sets = [a for item in TINY + [f"data.path={small_corpus}", f"train.out_dir={out}"] for a in ("--set", item)]
    assert main(["train", *sets]) == 0
    return out


def hpengine(args, cwd, stdout, stderr) -> int:
    """`python -m hpengine ARGS` with its own streams, outside any launcher."""
    env = {k: v for k, v in os.environ.items() if k not in bars.RANK_VARS and not k.startswith(("PMI", "OMPI", "PMIX"))}
    return subprocess.run([sys.executable, "-m", "hpengine", *map(str, args)], cwd=cwd, stdout=stdout,
                          stderr=stderr, stdin=subprocess.DEVNULL, env=env, timeout=300).returncode


def on_a_terminal(args, cwd, out_file) -> tuple[int, str]:
    """(exit status, what reached the terminal): stderr is a pty's slave end (80 columns), stdout a file."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    seen = []

    def drain():                 # read while the command runs: a full pty would block its writes
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:      # EIO: every copy of the slave end is closed
                return
            if not data:
                return
            seen.append(data)
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        with open(out_file, "w") as out:
            rc = hpengine(args, cwd, out, slave)
    finally:
        os.close(slave)
        reader.join(timeout=30)
        os.close(master)
    return rc, b"".join(seen).decode("utf-8", "replace")


def redirected(args, cwd, tmp_path) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) with both streams in files."""
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        rc = hpengine(args, cwd, out, err)
    return rc, (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()


def test_a_bar_is_drawn_on_a_terminal_by_rank_0_only(tmp_path, monkeypatch):
    for var in bars.RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty, open(tmp_path / "log", "w") as f:
            assert bars.watched(tty) and not bars.watched(f)
            assert not bars.watched(tty, rank=1)
            with bars.bar(3, "x", stream=f) as quiet, bars.bar(3, "x", stream=tty) as shown:
                assert quiet.disable and not shown.disable
            with bars.bar(3, "x", stream=f, show=True) as forced:       # data build --progress
                assert not forced.disable
            monkeypatch.setenv("PMI_RANK", "2")             # a launcher's rank 2: silent
            assert not bars.watched(tty)
            monkeypatch.setenv("PMI_RANK", "0")
            assert bars.watched(tty)
    finally:
        os.close(master)
        os.close(slave)
    assert bars.launcher_rank({"OMPI_COMM_WORLD_RANK": "3"}) == 3 and bars.launcher_rank({}) == 0


def test_eval_shows_progress_on_a_terminal_and_one_line_when_redirected(run, small_corpus, tmp_path):
    args = ["eval", run, "--data", small_corpus, "--batch", "2"]
    rc, tty = on_a_terminal(args, tmp_path, tmp_path / "stdout.txt")
    assert rc == 0, tty
    assert "evaluating" in tty and "batch" in tty                           # the bar, drawn and cleared
    rc, out, err = redirected(args, tmp_path, tmp_path)
    assert rc == 0, err
    assert err == "" and "evaluating" not in out
    lines = out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"eval {run} on {small_corpus}: ") and " batches in " in lines[0]


def test_generate_counts_tokens_on_a_terminal_when_its_text_goes_to_a_file(run, tmp_path):
    args = ["generate", run, "--prompt", "th", "--max-new-tokens", "12", "--greedy", "--device", "cpu"]
    rc, tty = on_a_terminal(args, tmp_path, tmp_path / "text.txt")
    assert rc == 0, tty
    assert "generating" in tty and "tok" in tty
    rc, out, err = redirected(args, tmp_path, tmp_path)
    assert rc == 0, err
    assert "generating" not in err and len(err.splitlines()) == 1 and err.startswith("generate: ")


@pytest.mark.parametrize("fmt, desc", [("hdf5", "writing"), ("hf", "reading parameters")])
def test_export_shows_bytes_on_a_terminal_and_one_line_when_redirected(run, tmp_path, fmt, desc):
    rc, tty = on_a_terminal(["ckpt", "export", run / "checkpoints", tmp_path / "a", "--format", fmt], tmp_path,
                            tmp_path / "stdout.txt")
    assert rc == 0, tty
    assert desc in tty
    rc, out, err = redirected(["ckpt", "export", run / "checkpoints", tmp_path / "b", "--format", fmt], tmp_path,
                              tmp_path)
    assert rc == 0, err
    assert desc not in err + out
    assert out.splitlines()[-1].startswith(f"wrote {tmp_path / 'b'}: ")


def test_data_build_shows_progress_on_a_terminal_only(tmp_path):
    (tmp_path / "a.txt").write_text("some text to tokenize\n" * 50)
    rc, tty = on_a_terminal(["data", "build", tmp_path / "a.txt", "--out", tmp_path / "t1.h5"], tmp_path,
                            tmp_path / "stdout.txt")
    assert rc == 0, tty
    assert "tokenizing" in tty
    rc, out, err = redirected(["data", "build", tmp_path / "a.txt", "--out", tmp_path / "t2.h5"], tmp_path, tmp_path)
    assert rc == 0, err
    assert "tokenizing" not in err + out and err == ""
    assert len(out.splitlines()) == 1 and "t2.h5" in out
