"""One-process checks of the fault handling: watchdog limits per phase, the peer/launcher monitor, the
memory check, run-folder paths, `plan` arguments, one-write error lines, metrics trimmed on resume."""
from __future__ import annotations

import io
import os
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from mpi4py import MPI

from hpengine.cli import commands as cli
from hpengine.run import faults
from hpengine.dist import watchdog
from hpengine.run import memcheck
from hpengine.config.load import load_config
from hpengine.layout.resolve import resolve
from hpengine.planner.search import predict_at_start
from hpengine.run.run_dir import trim_metrics

TINY = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "train.global_batch=4", "runtime.backend='numpy'"]


# ---- watchdog: saves, loads and evaluation get a scaled limit ---------------------------------------
def test_watchdog_does_not_fire_in_a_slow_save_but_does_in_a_step():
    fired = []
    w = watchdog.Watchdog(0.2, "[r0]", abort=lambda: fired.append(1), stream=io.StringIO(), grace_s=0,
                        slow_floor_s=0).start()
    try:
        assert w.limit("checkpoint") == pytest.approx(2.0) and w.limit("train_step") == pytest.approx(0.2)
        w.heartbeat(3, "checkpoint")
        time.sleep(0.8)                      # a save of 4 x the step limit is healthy
        assert not fired
        w.heartbeat(4, "train_step")
        time.sleep(0.8)
        assert fired and "limit 0.2 s in this phase" in w.stream.getvalue()
    finally:
        w.stop()


def test_slow_phases_have_a_floor():
    assert watchdog.Watchdog(1).limit("checkpoint") == watchdog.SLOW_FLOOR_S
    assert watchdog.Watchdog(1).limit("evaluate") == watchdog.SLOW_FLOOR_S
    assert watchdog.Watchdog(1).limit("train_step") == 1


# ---- monitor: a peer that dies is named; the interrupt grace -----------------------------------------
def _record(rank, pid):
    import socket
    return {"rank": rank, "host": socket.gethostname(), "pid": pid, "ppid": 1, "coords": {"dp": rank},
            "prefix": f"[r{rank} dp{rank}]"}


def test_monitor_names_a_peer_that_died():
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    aborted, out = [], io.StringIO()
    m = faults.Monitor([_record(0, 12345678), _record(1, peer.pid)], 0, watch_parent=False, poll_s=0.05,
                       peer_grace_s=0.1, abort=aborted.append, stream=out)
    m.me = _record(0, 12345678)
    m.peers = [_record(1, peer.pid)]
    m.start()
    try:
        time.sleep(0.3)
        assert not aborted
        peer.kill()
        peer.wait()
        for _ in range(50):
            if aborted:
                break
            time.sleep(0.05)
        assert aborted == [1]
        assert f"rank 1 [r1 dp1] (pid {peer.pid}" in out.getvalue()
    finally:
        m.stop()


def test_monitor_aborts_when_a_failure_is_recorded_in_the_run_folder(tmp_path):
    """A death its launcher missed (a rank on another node, recorded by that rank's supervisor) ends the job
    after the grace; what an earlier run of a resumed folder recorded does not."""
    (tmp_path / "failures.jsonl").write_text('{"event": "signal", "rank": 3}\n')     # the earlier run's
    aborted = []
    m = faults.Monitor([_record(0, os.getpid())], 0, watch_parent=False, poll_s=0.05, peer_grace_s=0.1,
                       abort=aborted.append, run_dir=tmp_path)
    m.start()
    try:
        time.sleep(0.4)
        assert not aborted
        with open(tmp_path / "failures.jsonl", "a") as f:
            f.write('{"event": "signal", "rank": 2}\n')
        for _ in range(50):
            if aborted:
                break
            time.sleep(0.05)
        assert aborted == [1]
    finally:
        m.stop()


def test_monitor_aborts_when_an_interrupt_is_not_agreed_in_time():
    aborted = []
    m = faults.Monitor([], 0, watch_parent=False, poll_s=0.05, interrupt_grace_s=0.2, abort=aborted.append,
                       stream=io.StringIO()).start()
    try:
        m.interrupted()
        time.sleep(0.6)
        assert aborted == [130]
    finally:
        m.stop()


def test_monitor_exits_when_the_parent_changes():
    exits = []
    m = faults.Monitor([_record(0, 1)], 0, watch_parent=True, poll_s=0.05, exit=exits.append,
                       stream=io.StringIO())
    m.ppid = -5               # as if the launcher that started us had died
    m.start()
    time.sleep(0.3)
    m.stop()
    assert exits == [faults.EXIT_ORPHANED] and "the launcher is gone" in m.stream.getvalue()


# ---- memory check ----------------------------------------------------------------------------------
def _cfg(*extra):
    return load_config(None, TINY + list(extra))


def _check(cfg, res, be, **kw):
    """The memory check as a start-up runs it: on the job's one prediction."""
    return memcheck.check_fits(cfg, res, MPI.COMM_SELF, be, predict_at_start(cfg, res)["memory"], **kw)


def test_memory_check_refuses_with_estimate_limit_and_switches():
    cfg = _cfg("model.d_model=4096")
    be = SimpleNamespace(is_gpu=False)
    with pytest.raises(memcheck.MemoryCheckError) as e:
        _check(cfg, resolve(cfg, 1), be, limit=(10**9, "a test limit"))
    msg = str(e.value)
    assert "per rank" in msg and "1 GB (a test limit)" in msg and "strategy.sharding" in msg
    assert "runtime.memory_check=false" in msg and "\n" not in msg


def test_memory_check_counts_the_async_checkpoint_snapshot():
    """On the CPU an asynchronous save keeps a copy of the saved state (params + Adam moments, float32:
    1.5 x the moments' bytes) in host memory: a limit between the two totals refuses async and passes sync."""
    be = SimpleNamespace(is_gpu=False)
    cfg = _cfg("model.d_model=512", "checkpoint.async=false")
    res = resolve(cfg, 1)
    base = predict_at_start(cfg, res)["memory"]
    snap = memcheck.snapshot_bytes(_cfg("model.d_model=512"), res, base)
    assert snap == int(1.5 * base["optimizer"])
    limit = (base["total"] + snap // 2, "a test limit")
    _check(cfg, res, be, limit=limit)
    with pytest.raises(memcheck.MemoryCheckError) as e:
        _check(_cfg("model.d_model=512"), res, be, limit=limit)
    assert "checkpoint snapshot" in str(e.value) and "checkpoint.async=false" in str(e.value)


def test_memory_check_can_be_switched_off_and_passes_small_jobs():
    be = SimpleNamespace(is_gpu=False)
    cfg = _cfg("model.d_model=4096", "runtime.memory_check=false")
    _check(cfg, resolve(cfg, 1), be, limit=(1, "tiny"))
    cfg = _cfg()
    _check(cfg, resolve(cfg, 1), be)      # the real MemAvailable


def test_absurd_batch_is_one_line(tmp_path, capsys):
    assert cli.main(["train", *sum([["--set", s] for s in TINY], []), "--set", "train.global_batch=1000000000000",
                     "--set", f"train.out_dir={tmp_path}/r", "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hpengine: error: the job needs about") and "\n" not in err


# ---- output paths and plan arguments: one line, exit 2 ---------------------------------------------
def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("where", ["file", "below", "empty"])
def test_bad_out_dir(tmp_path, capsys, where):
    (tmp_path / "f").write_text("x")
    out = {"file": tmp_path / "f", "below": tmp_path / "f" / "run", "empty": ""}[where]
    assert cli.main(["train", *sum([["--set", s] for s in TINY], []), "--set", f"train.out_dir={out}",
                     "--set", "train.steps=1"]) == 2
    err = _one_line(capsys)
    assert f"train.out_dir = '{out}'" in err


def test_out_folder_for_plan_and_data_build(tmp_path, capsys):
    assert cli.main(["plan", "--model", "gpt2-124m", "--out", str(tmp_path)]) == 2
    assert str(tmp_path) in _one_line(capsys)
    assert cli.main(["data", "build", "--out", str(tmp_path)]) == 2
    assert str(tmp_path) in _one_line(capsys)


@pytest.mark.parametrize("args,want", [
    (["--top", "0"], "--top 0"), (["--top", "-1"], "--top -1"), (["--global-batch", "0"], "--global-batch 0"),
    (["--max-micro-batch", "0"], "--max-micro-batch 0"), (["--world", "4"], "--world 4: only applies with --check")])
def test_plan_arguments(capsys, args, want):
    assert cli.main(["plan", "--model", "gpt2-124m", *args]) == 2
    assert want in _one_line(capsys)


def test_plan_check_world_zero_and_too_many_shards(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[model]\nkind = 'gpt'\nseq_len = 8\nd_model = 16\nn_layers = 2\nn_heads = 2\n[train]\n"
                   "global_batch = 64\n[strategy.sharding]\nenable = true\npartition = 'tensor'\n")
    assert cli.main(["plan", "--check", str(cfg), "--world", "0"]) == 2
    assert "--world 0" in _one_line(capsys)
    assert cli.main(["plan", "--check", str(cfg), "--world", "64", "--gpus-per-node", "64"]) == 2
    assert "exceeds the number of tensors" in _one_line(capsys)


# ---- one write per error line -----------------------------------------------------------------------
class Recorder(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


def test_error_line_and_its_newline_in_one_write(monkeypatch, tmp_path):
    rec = Recorder()
    monkeypatch.setattr(sys, "stderr", rec)
    assert cli.main(["plan", "--model", "gpt2-124m", "--top", "0"]) == 2
    assert [w for w in rec.writes if w] == ["hpengine: error: --top 0: must be an integer >= 1\n"]


# ---- metrics.jsonl on resume ------------------------------------------------------------------------
def test_trim_metrics_drops_replayed_steps(tmp_path):
    # rows number optimizer steps completed from 1: resuming the checkpoint of step 5 keeps rows 1..5
    rows = [{"step": s, "loss": 1.0} for s in range(1, 8)] + [{"step": 6, "loss": 2.0, "model": 1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trim_metrics(tmp_path, 5, rank=0)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
