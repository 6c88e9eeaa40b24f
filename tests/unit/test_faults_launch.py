"""Fault tests under a real launcher (the mpich wheel's Hydra mpiexec): Ctrl-C at random points ends every
rank within seconds with 130; a SIGKILLed rank is named; ranks whose launcher is SIGKILLed exit;
SIGTERM stops with 75 and summary.json says so; --resume leaves each step once in metrics.jsonl."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI  # noqa: F401 - MPI up: the start-up handler's raising path

from hpengine.config.load import load_config
from hpengine.run import startguard
from hpengine.run.train import train

MPIEXEC = Path(sys.executable).parent / "mpiexec"
pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec from the mpich wheel not installed")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
T = ["model.kind=gpt", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
     "train.global_batch=4", "runtime.backend=numpy", "model.dtype=float64", "train.steps=100000"]
HP = [sys.executable, "-m", "hpengine", "train"]     # the hpengine on sys.path (cwd is a temporary folder)


def _sets(items):
    return [a for s in items for a in ("--set", s)]


STARTED = []


@pytest.fixture(autouse=True)
def _no_leftovers():
    """A failing test leaves no job behind (the launcher's session, and the ranks it listed)."""
    yield
    while STARTED:
        p, out = STARTED.pop()
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            _kill_pids([json.loads(x)["pid"] for x in (out / "ranks.jsonl").read_text().splitlines()])
        except (OSError, ValueError):
            pass


def _start(n, out, extra=(), launcher=True):
    cmd = ([str(MPIEXEC), "-n", str(n)] if launcher else []) + HP + _sets([*T, *extra, f"train.out_dir={out}"])
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                         cwd=out.parent, start_new_session=True)
    STARTED.append((p, out))
    return p


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _ranks(out: Path, n: int, timeout: float = 40.0) -> list[dict]:
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        try:
            rows = [json.loads(x) for x in (out / "ranks.jsonl").read_text().splitlines()]
            if len(rows) == n and (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size:
                return rows
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"no ranks.jsonl with {n} rows and no metrics in {timeout} s")


def _end(p, timeout):
    """(return code or None if still running after timeout, stderr); the job is killed in any case."""
    try:
        _, err = p.communicate(timeout=timeout)
        return p.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        return None, err


def _kill_pids(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for_ranks(p, n, timeout=20.0):
    """Until the launcher has started n rank processes (Python running `-m hpengine`). A SIGINT inside
    Hydra's own spawn window (its first few tenths of a second) can leave the mpich wheel's mpiexec waiting
    forever after its proxy fails an assertion, whatever the ranks do (a second Ctrl-C ends it): that
    window is the launcher's, so the random points start once the ranks exist."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        parent, hp = {}, set()
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit():
                    parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    if b"-m\0hpengine" in (d / "cmdline").read_bytes():
                        hp.add(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
        # Hydra puts its proxy and every rank in sessions of their own: follow the parents instead
        if sum(parent.get(parent.get(pid, 0), 0) == p.pid for pid in hp) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{n} ranks did not start within {timeout} s")


def _import_time_only(err: str) -> bool:
    """Whether every Python traceback in err was raised while modules were still loading: each frame is a
    module's top level or the import machinery (a rank killed mid-write may cut the traceback short of its
    KeyboardInterrupt line, so the frames decide, not that line)."""
    for chunk in err.split("Traceback (most recent call last):")[1:]:
        frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', chunk)
        if not all(fn == "<module>" or path.startswith("<frozen") for path, fn in frames):
            return False
    return not re.search(r"^\w+(Error|Exception): ", err, re.M)


def test_import_time_traceback_rule_tells_loading_from_running():
    loading = ('Traceback (most recent call last):\n  File "/v/bin/hpengine", line 5, in <module>\n'
               '    from hpengine.cli import main\n  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load\n')
    running = ('Traceback (most recent call last):\n  File "/v/hpengine/run/train.py", line 90, in train\n'
               '    eng.train_step(s)\nKeyboardInterrupt\n')
    assert _import_time_only("") and _import_time_only(loading) and _import_time_only(loading + "KeyboardInterrupt\n")
    assert not _import_time_only(running) and not _import_time_only(loading + running)
    assert not _import_time_only("ValueError: bad\n")


def test_sigint_at_random_points_ends_every_rank_within_10_s(tmp_path):
    rng = random.Random(7)
    results = []
    for i in range(10):
        out = tmp_path / f"r{i}"
        extra = (["strategy.data_parallel.enable=true"] if i % 2 == 0 else
                 ["strategy.sharding.enable=true", "strategy.sharding.stage=3", "train.global_batch=8"])
        p = _start(4, out, extra)
        _wait_for_ranks(p, 4)
        time.sleep(rng.uniform(0.0, 4.0))       # in the ranks' imports, MPI start-up, build, or the loop
        p.send_signal(signal.SIGINT)
        t = time.monotonic()
        rc, err = _end(p, 10)
        results.append((rc, round(time.monotonic() - t, 1)))
        assert rc is not None, f"try {i}: still running 10 s after SIGINT; stderr: {err[-2000:]}"
        assert rc != 0, f"try {i}: an interrupted run exited 0"
        # a Ctrl-C while Python is still importing prints the interpreter's own KeyboardInterrupt traceback;
        # once hpengine runs, an interrupt is one line
        assert _import_time_only(err), err[-2000:]
    assert sum(rc == 130 for rc, _ in results) >= 5, results


def test_ranks_file_maps_pids_to_ranks(tmp_path):
    out = tmp_path / "r"
    p = _start(2, out, ["strategy.data_parallel.enable=true"])
    try:
        ranks = _ranks(out, 2)
        assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
        for r in ranks:
            assert not _gone(r["pid"]) and "hpengine" in Path(f"/proc/{r['pid']}/cmdline").read_text()
            assert set(r["coords"]) == {"tp", "cp", "sharding", "dp", "pp"} and r["host"]
    finally:
        p.send_signal(signal.SIGINT)
        _end(p, 10)


def test_killed_rank_is_in_the_ranks_file(tmp_path):
    """A SIGKILLed rank: the job ends, and the pid the launcher reports maps to its rank in ranks.jsonl
    (naming it from a survivor races Hydra's kill of the survivors; test_faults.py tests that logic)."""
    out = tmp_path / "r"
    p = _start(4, out, ["strategy.data_parallel.enable=true"])
    ranks = _ranks(out, 4)
    victim = next(r for r in ranks if r["rank"] == 2)
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{victim['pid']}/environ").read_text().split("\0") if "=" in kv)
    assert env.get("PMI_RANK") == "2"              # the launcher's own word for which rank that pid is
    os.kill(victim["pid"], signal.SIGKILL)
    rc, err = _end(p, 20)
    assert rc is not None and rc != 0


def test_ranks_exit_when_their_launcher_is_killed(tmp_path):
    out = tmp_path / "r"
    p = _start(2, out, ["strategy.data_parallel.enable=true"])
    pids = [r["pid"] for r in _ranks(out, 2)]
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    t = time.monotonic()
    while time.monotonic() - t < 10 and not all(_gone(pid) for pid in pids):
        time.sleep(0.1)
    left = [pid for pid in pids if not _gone(pid)]
    _kill_pids(left)
    assert not left, f"ranks {left} still running 10 s after their mpiexec was killed"


def test_sigterm_stops_with_75_and_says_so(tmp_path):
    out = tmp_path / "r"
    p = _start(1, out, launcher=False)
    _ranks(out, 1)
    p.send_signal(signal.SIGTERM)
    rc, err = _end(p, 30)
    assert rc == 75, err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] == "SIGTERM"
    assert any((out / "checkpoints").iterdir())


def test_resume_leaves_each_step_once_in_metrics(tmp_path, small_corpus):
    out = tmp_path / "run"
    base = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
            "train.global_batch=4", "runtime.backend='numpy'", f"data.path={small_corpus}",
            f"train.out_dir={out}", "checkpoint.every=3", "checkpoint.keep=5"]
    train(load_config(None, base + ["train.steps=5"]))      # saves steps 3 and 5; metrics rows 1..5
    step3 = sorted((out / "checkpoints").glob("step_*"))[0]
    s = train(load_config(None, base + ["train.steps=7"]), resume=str(step3))   # a crash after step 3
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 8)) and s["stopped_early"] is None     # after step 3 comes step 4, once


def test_an_interrupt_inside_a_weakref_callback_is_delivered_again_not_dropped(monkeypatch):
    """Raised inside a weakref callback or a finalizer, a KeyboardInterrupt is printed as "Exception ignored" and
    lost: there the handler sends SIGINT to the process again (handled once out of the callback) instead."""
    frames = {}
    for name, path in (("remove", "/usr/lib/python3.11/weakref.py"), ("__del__", "/x/data.py"),
                       ("step", "/x/engine.py")):
        code = compile(f"def {name}():\n    return sys._getframe()\n", path, "exec")
        scope = {"sys": sys}
        exec(code, scope)
        frames[name] = scope[name]()
    sent = []
    monkeypatch.setattr(startguard.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setitem(startguard._state, "caught", True)
    for name in ("remove", "__del__"):
        assert startguard.swallowed(frames[name])
        startguard._on_sigint(signal.SIGINT, frames[name])
    assert sent == [(os.getpid(), signal.SIGINT)] * 2
    assert not startguard.swallowed(frames["step"]) and not startguard.swallowed(None)
    with pytest.raises(KeyboardInterrupt):
        startguard._on_sigint(signal.SIGINT, frames["step"])
