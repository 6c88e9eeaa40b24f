"""A run ends cleanly whatever is in flight: a divergence while a background checkpoint is written (the writer
finishes first, the line names the rank), a float16 run whose loss scale collapses (exit 2, the last good
checkpoint stays the latest), a slow but moving save under a small runtime.watchdog_s, a SIGKILLed rank
named even by a launcher that stops reading a process's output once it has exited, and the first lines of
a run under Open MPI (how to stop it resumably, how to continue)."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpengine.checkpoint import guard as ckpt_guard, write as ckpt_write
from hpengine.cli.commands import main
from hpengine.config.load import load_config
from hpengine.dist import watchdog
from hpengine.engine.engine import NonFiniteError
from hpengine.run import launch, supervisor, train as train_mod
from hpengine.run.train import continue_command, train
from hpengine.strategies.amp import Precision

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.kind='gpt'", "model.seq_len=8", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "train.global_batch=4", "runtime.backend='numpy'", "train.log_every=1000"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def tiny(data, out, *extra):
    return load_config(None, TINY + [f"data.path={data}", f"train.out_dir={out}", *extra])


def sets(data, out, *extra) -> list[str]:
    return [a for s in [*TINY, f"data.path={data}", f"train.out_dir={out}", *extra] for a in ("--set", s)]


def slow_pieces(monkeypatch, pause_s: float) -> None:
    """The shard writer pauses after each piece it writes (every byte is still written, piece by piece)."""
    real = ckpt_guard.write_at

    def write_at(path, parts):
        for part in parts:
            real(path, [part])
            time.sleep(pause_s)
    monkeypatch.setattr(ckpt_guard, "write_at", write_at)


def step_folders(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(("step_", ".tmp-")))


# ---- a divergence while a background save is written --------------------------------------------------
def test_a_divergence_during_a_background_save_waits_for_the_writer_and_names_the_rank(tmp_path, small_corpus,
                                                                                      monkeypatch):
    """optim.lr = 1e5 diverges at step 3, while the background writer of step 2's checkpoint still writes:
    the run waits for it (no thread left in h5py at exit), drops that save, and names rank 0."""
    slow_pieces(monkeypatch, 0.05)
    out = tmp_path / "run"
    cfg = tiny(small_corpus, out, "optim.lr=1e5", "train.steps=8", "checkpoint.async=true", "checkpoint.every=1")
    with pytest.raises(NonFiniteError, match=r"non-finite loss or gradient on rank\(s\) \[0\]"):
        train(cfg)
    assert [t.name for t in threading.enumerate() if t.name.startswith("hpengine-checkpoint")] == []
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert step_folders(out) == ["step_00000001"]        # the abandoned save left nothing behind


def test_the_command_ends_at_once_on_a_divergence_during_a_background_save(tmp_path, small_corpus):
    """The same from the command line: exit status 2 and one line, never a hang or a crash at exit."""
    script = tmp_path / "slow_save.py"
    script.write_text(
        "import sys, time\n"
        "from hpengine.checkpoint import guard\n"
        "real = guard.write_at\n"
        "def write_at(path, parts):\n"
        "    for part in parts:\n"
        "        real(path, [part])\n"
        "        time.sleep(0.05)\n"
        "guard.write_at = write_at\n"
        "from hpengine.cli.commands import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "run"
    args = ["train", *sets(small_corpus, out, "optim.lr=1e5", "train.steps=8", "checkpoint.async=true",
                           "checkpoint.every=1")]
    p = subprocess.run([sys.executable, "-X", "faulthandler", str(script), *args], capture_output=True, text=True,
                       env=ENV, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    errors = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(errors) == 1 and errors[0].startswith("hpengine: error: step "), p.stderr[-3000:]
    assert "non-finite loss or gradient on rank(s) [0]" in errors[0]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def test_a_gradient_norm_beyond_float64_names_the_rank(tmp_path, small_corpus):
    """float64 gradients can all be finite while their squares overflow: the rank is named all the same."""
    cfg = tiny(small_corpus, tmp_path / "run", "model.dtype='float64'", "optim.lr=1e10", "train.steps=30",
               "checkpoint.at_end=false")
    with pytest.raises(NonFiniteError, match=r"on rank\(s\) \[0\] \(losses here: \[[^]]+\]; squared gradient "
                                             r"norm here: inf\)"):
        train(cfg)


# ---- float16: a loss scale that collapses stops the run -------------------------------------------------
AMP = ["strategy.amp.enable=true", "strategy.amp.dtype='float16'"]


def test_a_collapsed_loss_scale_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, small_corpus,
                                                                                monkeypatch):
    """Every step from step 4 on overflows: the steps are skipped, no periodic save is made of them, and once
    the scale falls under 2**-24 the run stops with one line naming the step and the scale; the model is
    not saved at the end and `latest` still names step 3."""
    real, calls = Precision.ready_grad, []

    def overflowing_from_step_4(self, xp, g, all_finite):
        calls.append(1)
        return None if len(calls) > 3 else real(self, xp, g, all_finite)
    monkeypatch.setattr(Precision, "ready_grad", overflowing_from_step_4)
    out = tmp_path / "run"
    cfg = tiny(small_corpus, out, *AMP, "strategy.amp.init_scale=1024", "checkpoint.every=3", "train.steps=60",
               "checkpoint.async=false")
    with pytest.raises(NonFiniteError) as caught:
        train(cfg)
    # 1024 = 2**10 halves 35 times to 2**-25, under the floor: the 35th overflow, at step 38
    assert str(caught.value).startswith("step 38: the gradients overflowed on 35 steps in a row (every one "
                                        "skipped) and the loss scale fell to 2.98023e-08 (under the floor 2**-24")
    assert 'strategy.amp.dtype = "bfloat16"' in str(caught.value) and "optim.lr" in str(caught.value)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert step_folders(out) == ["step_00000003"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 38)) and all(r.get("skipped") for r in rows[3:])


def test_max_skipped_stops_a_run_whose_scale_falls_slowly(tmp_path, small_corpus, monkeypatch):
    monkeypatch.setattr(Precision, "ready_grad", lambda self, xp, g, all_finite: None)
    cfg = tiny(small_corpus, tmp_path / "run", *AMP, "strategy.amp.backoff=0.9", "strategy.amp.max_skipped=5",
               "train.steps=20", "checkpoint.at_end=true")
    with pytest.raises(NonFiniteError, match=r"^step 5: the gradients overflowed on 5 steps in a row .* "
                                             r"\(strategy.amp.max_skipped = 5\)"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()


def test_a_diverged_float16_run_exits_2_with_one_line_and_saves_nothing(tmp_path, small_corpus, capfd):
    out = tmp_path / "run"
    rc = main(["train", *sets(small_corpus, out, *AMP, "optim.lr=1e5", "train.steps=80")])
    err = [x for x in capfd.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("hpengine: error: step ") and "the loss scale fell to" in err[0], err[0]
    assert not (out / "checkpoints" / "latest").exists()          # the diverged model is not saved


# ---- the watchdog never takes a healthy save for a hang -------------------------------------------------
def watched(monkeypatch, **kw) -> list:
    """train.py's Watchdog replaced by one that records instead of aborting; the list of those made."""
    made = []

    def make(timeout_s, prefix=""):
        made.append(watchdog.Watchdog(timeout_s, prefix, abort=lambda: None, stream=io.StringIO(), grace_s=0, **kw))
        return made[-1]
    monkeypatch.setattr(train_mod, "Watchdog", make)
    return made


def test_publishing_a_background_save_is_checkpoint_time_not_step_time(tmp_path, small_corpus, monkeypatch):
    """A background save's publishing takes 1.5 s (a slow fsync) at the next step boundary; with
    runtime.watchdog_s = 0.5 s, ten times a tiny step, nothing fires."""
    real = ckpt_write.SaveJob.publish

    def slow_publish(self, *a, **k):
        time.sleep(1.5)
        return real(self, *a, **k)
    monkeypatch.setattr(ckpt_write.SaveJob, "publish", slow_publish)
    made = watched(monkeypatch)
    cfg = tiny(small_corpus, tmp_path / "run", "runtime.watchdog_s=0.5", "train.steps=2", "checkpoint.every=1",
               "checkpoint.async=true")
    train(cfg)
    assert not made[0].fired, made[0].stream.getvalue()[:600]


def test_a_slow_save_that_keeps_writing_is_not_a_hang(tmp_path, small_corpus, monkeypatch):
    """Without the floor of 300 s the checkpoint phase's limit is 2 x watchdog_s = 1 s here; the save takes
    about 2 s, writing a piece every 0.05 s: the watchdog sees it move and stays quiet."""
    slow_pieces(monkeypatch, 0.05)
    monkeypatch.setattr(watchdog, "SLOW_FACTOR", 2.0)
    made = watched(monkeypatch, slow_floor_s=0)
    out = tmp_path / "run"
    t = time.monotonic()
    train(tiny(small_corpus, out, "runtime.watchdog_s=0.5", "train.steps=2", "checkpoint.async=false"))
    assert time.monotonic() - t > 1.5           # the save did take longer than the phase's limit
    assert not made[0].fired, made[0].stream.getvalue()[:600]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_the_watchdog_counts_a_moving_probe_as_progress_and_a_still_one_as_a_hang():
    fired, moved = [], [0]
    w = watchdog.Watchdog(0.1, "[r0]", abort=lambda: fired.append(1), stream=io.StringIO(), grace_s=0,
                          slow_floor_s=0).start()       # the checkpoint phase's limit: 1 s
    try:
        w.heartbeat(3, "checkpoint", lambda: moved[0])
        for _ in range(30):                     # 1.5 s of a moving probe
            moved[0] += 1
            time.sleep(0.05)
        assert not fired
        time.sleep(1.6)                         # then no move for longer than the limit
        assert fired
        line = w.stream.getvalue().splitlines()[0]
        assert "limit 1 s in this phase), in step 3, phase 'checkpoint'" in line, line
    finally:
        w.stop()


# ---- a SIGKILLed rank is named even by a launcher that stops reading once a process has exited ----------
RANK = """
import os, sys, time
from hpengine.run import supervisor
run_dir = sys.argv[1]
supervisor.supervise()
supervisor.report({"rank": 1, "host": "h", "pid": os.getpid(), "coords": {"dp": 1}, "prefix": "[r1 dp1]",
                   "supervisor_pid": supervisor.parent_pid()}, run_dir)
with open(os.path.join(run_dir, "pid.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(run_dir, "pid.tmp"), os.path.join(run_dir, "pid"))
time.sleep(60)
"""


def launch_reading_while_alive(cmd, env, poll_s=0.3, timeout_s=30.0) -> str:
    """Start cmd as a launcher whose forwarding of a process's output ends with the process does: every
    poll_s it forwards what the process wrote, but once it sees the process gone it reads nothing more."""
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env, start_new_session=True)
    os.set_blocking(p.stderr.fileno(), False)
    got, t = b"", time.monotonic()
    try:
        while time.monotonic() - t < timeout_s:
            time.sleep(poll_s)
            if p.poll() is not None:
                break
            try:
                got += os.read(p.stderr.fileno(), 65536) or b""
            except BlockingIOError:
                pass
        return got.decode()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        p.stderr.close()


def test_each_sigkilled_rank_is_named_by_a_launcher_that_stops_reading_at_its_exit(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    for attempt in range(3):
        run_dir = tmp_path / f"r{attempt}"
        run_dir.mkdir()
        killer = threading.Thread(target=_kill_when_started, args=(run_dir,))
        killer.start()
        err = launch_reading_while_alive([sys.executable, str(script), str(run_dir)], {**ENV, "PMI_RANK": "1"})
        killer.join()
        child = int((run_dir / "pid").read_text())
        want = (f"hpengine: rank 1 [r1 dp1] (pid {child} on h) was killed by SIGKILL (signal 9): killed by a user, "
                "the scheduler or the out-of-memory killer (`dmesg` or `journalctl -k` says which); the job ends")
        assert err.splitlines() == [want], f"kill {attempt + 1} of 3: {err!r}"
        (entry,) = [json.loads(x) for x in (run_dir / supervisor.FAILURES).read_text().splitlines()]
        assert (entry["rank"], entry["pid"], entry["signal"]) == (1, child, "SIGKILL")


def _kill_when_started(run_dir: Path) -> None:
    t = time.monotonic()
    while not (run_dir / "pid").exists() and time.monotonic() - t < 30:
        time.sleep(0.02)
    time.sleep(0.1)
    os.kill(int((run_dir / "pid").read_text()), signal.SIGKILL)


MPIEXEC = Path(sys.executable).parent / "mpiexec"


@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec from the mpich wheel not installed")
def test_the_same_rank_killed_three_times_under_hydra_is_named_each_time(tmp_path, small_corpus):
    for attempt in range(3):
        out = tmp_path / f"r{attempt}"
        cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "hpengine", "train",
               *sets(small_corpus, out, "strategy.data_parallel.enable=true", "model.dtype='float64'",
                     "train.steps=100000", "checkpoint.every_minutes=0", "checkpoint.at_end=false")]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                             cwd=tmp_path, start_new_session=True)
        try:
            rec = _trained(out, p)[1]
            os.kill(rec["pid"], signal.SIGKILL)
            _, err = p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
        want = (f"hpengine: rank 1 {rec['prefix']} (pid {rec['pid']} on {rec['host']}) was killed by SIGKILL "
                "(signal 9)")
        named = [x for x in err.splitlines() if x.startswith("hpengine: ")]
        assert len(named) == 1 and named[0].startswith(want), f"kill {attempt + 1} of 3: {err[-3000:]}"


def _trained(out: Path, p, timeout_s: float = 60.0) -> list[dict]:
    """ranks.jsonl's records once the job has logged a step."""
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        assert p.poll() is None, p.stderr.read()[-3000:]
        try:
            rows = [json.loads(x) for x in (out / "ranks.jsonl").read_text().splitlines()]
            if len(rows) == 2 and (out / "metrics.jsonl").stat().st_size:
                return rows
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError("the job did not train within 60 s")


# ---- under Open MPI the first lines say how to stop resumably and how to continue -----------------------
def test_open_mpi_start_note_says_how_to_stop_and_continue():
    cont = continue_command("/runs/a b")
    assert cont == "hpengine train '/runs/a b'/config.toml --resume auto"
    note = launch.open_mpi_start_note(cont, {"OMPI_COMM_WORLD_RANK": "0", "PMIX_NAMESPACE": "prterun-vm-4242@1"})
    assert note.startswith("launched by Open MPI's mpirun: Ctrl-C or SIGTERM to mpirun ends the ranks")
    assert "kill -USR1 4242" in note and "kill -TERM" in note and "ranks.jsonl" in note and "exit 75" in note
    assert note.endswith(f"To continue: {cont}")
    assert launch.open_mpi_start_note(cont, {"PMI_RANK": "0"}) is None


def test_a_run_under_open_mpi_says_it_first(tmp_path, small_corpus, monkeypatch, capsys):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    out = tmp_path / "run"
    train(tiny(small_corpus, out, "train.steps=1"))
    lines = [x.split("] ", 1)[-1] for x in capsys.readouterr().out.splitlines()]
    note = next(i for i, x in enumerate(lines) if x.startswith("launched by Open MPI's mpirun"))
    assert lines[note].endswith(f"To continue: {continue_command(out)}")
    assert note < next(i for i, x in enumerate(lines) if x.startswith("config (resolved"))
