"""hpengine.run.launch: the world-size check against launcher variables (fake worlds, patched env), the hang
watchdog and the stop signals in process, and under a real mpiexec: one rank failing or hanging ends
the whole job within seconds, a SIGTERM on one rank stops every rank after the same step."""
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
from mpi4py import MPI

from hpengine.run import launch
from hpengine.dist import watchdog

BIN = Path(sys.executable).parent
MPIEXEC = BIN / "mpiexec"
ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "SLURM_NTASKS",
               "SLURM_NPROCS", "PBS_NP", "PBS_NODEFILE", "MPI_LOCALNRANKS")
needs_mpiexec = pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec from the mpich wheel not installed")


@pytest.fixture(autouse=True)
def restore_launch_state():
    """Watchdogs and signal handlers record per-process state; give each test a clean copy."""
    saved, saved_wd = dict(launch._state), dict(watchdog._state)
    yield
    launch._state.update(saved)
    watchdog._state.update(saved_wd)


class FakeWorld:
    """Size and an allgather that returns what the other ranks would have seen."""

    def __init__(self, size, others=()):
        self.size, self.others = size, list(others)

    def Get_size(self):
        return self.size

    def allgather(self, obj):
        return [obj, *self.others]


# --- launcher sanity ----------------------------------------------------------------------------
@pytest.mark.parametrize("env, want", [
    ({}, None),
    ({"OMPI_COMM_WORLD_SIZE": "4", "SLURM_NTASKS": "8"}, (4, "launched")),
    ({"PMI_SIZE": "2", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "0"}, (2, "launched")),  # Hydra over srun
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}, (4, "launched")),
    ({"SLURM_STEP_ID": "0", "SLURM_NPROCS": "3"}, (3, "launched")),
    ({"SLURM_NTASKS": "4"}, (4, "allocation")),          # the batch script itself, no step
    ({"PBS_NP": "8"}, (8, "allocation")),
])
def test_launcher_size_priority(env, want):
    got = launch.launcher_size(env)
    assert (got if got is None else (got[0], got[2])) == want


def test_launcher_size_counts_pbs_nodefile(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("n1\nn1\nn2\nn2\n\n")
    n, source, kind = launch.launcher_size({"PBS_NODEFILE": str(nodefile)})
    assert (n, kind) == (4, "allocation") and "PBS_NODEFILE" in source
    assert launch.launcher_size({"PBS_NODEFILE": str(tmp_path / "missing")}) is None


def test_wrong_srun_mpi_type_is_a_clear_error():
    env = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}
    with pytest.raises(launch.LaunchError) as e:
        launch.check_world(FakeWorld(1), env)
    msg = str(e.value)
    assert "asked for 4 ranks" in msg and "world of 1 rank" in msg and "rank 0 of 1" in msg
    assert "--mpi=pmi2" in msg and "LAUNCHER=mpiexec" in msg


def test_foreign_mpirun_and_foreign_mpiexec_name_the_right_fix():
    with pytest.raises(launch.LaunchError, match="Open MPI's mpirun.*mpiexec -n 4"):
        launch.check_world(FakeWorld(1), {"OMPI_COMM_WORLD_SIZE": "4"})
    want = r"asked for 8 ranks \(PMI_SIZE=8, .*another MPI than mpi4py's; use \S+mpiexec -n 8"
    with pytest.raises(launch.LaunchError, match=want):
        launch.check_world(FakeWorld(2, [None]), {"PMI_SIZE": "8"})


def test_matching_or_unknown_launch_passes():
    launch.check_world(FakeWorld(4, [None] * 3), {"PMI_SIZE": "4", "SLURM_NTASKS": "1"})
    launch.check_world(FakeWorld(1), {})
    launch.check_world(FakeWorld(1), {"SLURM_NTASKS": "4"})   # one process in an salloc shell: allowed
    launch.check_world(FakeWorld(1), {"PBS_NP": "16"})


def test_disagreement_between_ranks_raises_everywhere():
    with pytest.raises(launch.LaunchError, match="from another rank"):
        launch.check_world(FakeWorld(2, [("LaunchError", "from another rank")]), {})


def test_sub_communicator_is_not_checked(monkeypatch):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    launch.check_world(MPI.COMM_SELF)                       # tests and embedding use sub-communicators
    with pytest.raises(launch.LaunchError):
        launch.check_world(MPI.COMM_WORLD)                  # reads os.environ by default


def test_cli_reports_launch_error_in_one_line(tmp_path, small_corpus):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="4")
    p = subprocess.run([sys.executable, "-m", "hpengine", "train", "--set", f"data.path={small_corpus}",
                        "--set", f"train.out_dir={tmp_path}/r"], capture_output=True, text=True, env=env,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("hpengine: error: the launcher asked for 4 ranks") == 1
    assert "Traceback" not in p.stderr and not (tmp_path / "r").exists()


# --- watchdog and signals in process -------------------------------------------------------------
def _fired(timeout_s, beat_every=None, run_s=0.6):
    out, aborted = io.StringIO(), threading.Event()
    wd = watchdog.Watchdog(timeout_s, "[r0 dp0 sh0 pp0 tp0]", abort=aborted.set, stream=out, grace_s=0,
                         slow_floor_s=0).start()     # start-up's limit: 10 x timeout_s
    t_end = time.monotonic() + run_s
    step = 0
    while time.monotonic() < t_end and not aborted.is_set():
        if beat_every:
            wd.heartbeat(step, "train_step")
            step += 1
        time.sleep(beat_every or 0.02)
    wd.stop()
    return aborted.is_set(), out.getvalue()


def test_watchdog_fires_without_heartbeats_and_names_rank_and_phase():
    watchdog.note_comm("allreduce", "dp", 4096)
    fired, text = _fired(0.2, run_s=5)
    assert fired
    first = text.splitlines()[0]
    assert first.startswith("hpengine: watchdog: rank 0 [r0 dp0 sh0 pp0 tp0] made no progress")
    assert "before the first step" in first and "allreduce on 'dp', 4,096 bytes" in first
    assert "_fired" in text                                  # this thread's stack is in the dump


def test_watchdog_quiet_while_heartbeats_come_and_off_at_zero():
    assert _fired(0.3, beat_every=0.02) == (False, "")
    wd = watchdog.Watchdog(0, "x").start()
    assert wd._thread is None
    wd.stop()


def test_stop_signal_sets_flag_and_restores_handler():
    before = signal.getsignal(signal.SIGUSR1)
    restore = launch.install_stop_handlers()
    try:
        assert launch.stop_requested() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert launch.stop_requested() == "SIGUSR1"
    finally:
        restore()
    assert signal.getsignal(signal.SIGUSR1) is before


# --- under mpiexec -------------------------------------------------------------------------------
INJECT = """
import os, signal, sys, time
from mpi4py import MPI
from hpengine.cli import commands as cli
from hpengine.engine import engine
mode, rank, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
orig = engine.Engine.train_step
def train_step(self, step):
    if step == at and MPI.COMM_WORLD.Get_rank() == rank:
        if mode == "raise":
            raise RuntimeError(f"injected failure at step {step}")
        if mode == "sleep":
            time.sleep(300)
        if mode == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
    return orig(self, step)
engine.Engine.train_step = train_step
sys.exit(cli.main(sys.argv[4:]))
"""
TINY = ["model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.seq_len=8", "train.global_batch=8",
        "train.steps=8", "train.eval_every=0", "strategy.data_parallel.enable=true"]


def _mpiexec(n, args, timeout=60):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    t = time.perf_counter()
    p = subprocess.run([str(MPIEXEC), "-n", str(n), sys.executable, *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=ROOT)
    return p, time.perf_counter() - t


def _inject(tmp_path, corpus, n, mode, rank, at, *sets):
    script = tmp_path / "inject.py"
    script.write_text(INJECT)
    overrides = [f"data.path={corpus}", f"train.out_dir={tmp_path}/run", *TINY, *sets]
    return _mpiexec(n, [str(script), mode, str(rank), str(at), "train",
                        *[a for s in overrides for a in ("--set", s)]])


@needs_mpiexec
def test_exception_on_one_rank_aborts_the_job_quickly(tmp_path, small_corpus):
    p, dt = _inject(tmp_path, small_corpus, 4, "raise", 1, 3)
    assert p.returncode != 0 and dt < 20, (p.returncode, dt)
    assert "hpengine: rank 1 of 4 [r1 dp1 sh0 pp0 tp0] failed" in p.stderr
    assert "injected failure at step 3" in p.stderr


@needs_mpiexec
def test_watchdog_in_train_loop_aborts_a_hung_rank(tmp_path, small_corpus):
    p, dt = _inject(tmp_path, small_corpus, 4, "sleep", 1, 2, "runtime.watchdog_s=2")
    assert p.returncode != 0 and dt < 30, (p.returncode, dt)
    assert "hpengine: watchdog: rank 1 [r1 dp1 sh0 pp0 tp0] made no progress" in p.stderr
    assert "in step 3, phase 'train_step'" in p.stderr and "time.sleep(300)" not in p.stdout   # the third step
    assert "Thread 0x" in p.stderr                           # faulthandler's stack dump


@needs_mpiexec
def test_sigterm_on_one_rank_stops_every_rank_after_that_step(tmp_path, small_corpus):
    p, _ = _inject(tmp_path, small_corpus, 2, "sigterm", 0, 2)
    assert p.returncode == 75, p.stderr            # stopped early, resumable
    assert "SIGTERM received: stopping cleanly after step 3 of 8" in p.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


WATCHDOG_ONLY = """
import sys, time
from mpi4py import MPI
from hpengine.dist.watchdog import Watchdog
w = MPI.COMM_WORLD
wd = Watchdog(float(sys.argv[1]), f"[r{w.Get_rank()} dp{w.Get_rank()} sh0 pp0 tp0]").start()
wd.heartbeat(7, "gradient sync")
if w.Get_rank() == 0:
    time.sleep(300)      # the hung rank
w.Barrier()              # the others wait for it forever
"""


@needs_mpiexec
def test_watchdog_aborts_rank_blocked_in_barrier(tmp_path):
    script = tmp_path / "wd.py"
    script.write_text(WATCHDOG_ONLY)
    p, dt = _mpiexec(2, [str(script), "1.0"])
    assert p.returncode != 0 and dt < 20, (p.returncode, dt)
    for r in (0, 1):   # both ranks report before the abort (the grace period)
        assert f"hpengine: watchdog: rank {r} [r{r} dp{r} sh0 pp0 tp0] made no progress" in p.stderr
    assert "in step 7, phase 'gradient sync'" in p.stderr
    assert "in <module>" in p.stderr


# --- mpirun_examples: every script runs as documented ----------------------------------------------
EXAMPLES = sorted((ROOT / "mpirun_examples").glob("[0-9][0-9]_*.sh"))

# What each example that does not train must print (rank 0), worked out from the script:
# 00: 4 ranks, tp = 2, dp = the 2 left over, tp innermost, so world rank = tp + 2 dp: ranks {0, 1} and {2, 3}
#     share a tp group, ranks {0, 2} and {1, 3} a dp group.
# 08: 2 ranks all-reduce (rank + 1): 1 + 2 = 3 in every element.
EXAMPLE_OUTPUT = {
    "00_mesh_hello": [
        "mesh pp=1 x dp=2 x sharding=1 x tp=2 (order innermost first: tp, sharding, dp, pp) on 4 ranks",
        "[r0 dp0 sh0 pp0 tp0] tp group [0, 1], dp group [0, 2]",
        "[r1 dp0 sh0 pp0 tp1] tp group [0, 1], dp group [1, 3]",
        "[r2 dp1 sh0 pp0 tp0] tp group [2, 3], dp group [0, 2]",
        "[r3 dp1 sh0 pp0 tp1] tp group [2, 3], dp group [1, 3]",
    ],
    "08_allreduce_buffers": [
        "numpy: [3.0, 3.0, 3.0, 3.0] (expected 3.0 everywhere: True)",
    ],
}


@needs_mpiexec
@pytest.mark.parametrize("script", EXAMPLES, ids=[s.stem for s in EXAMPLES])
def test_example_runs(script, tmp_path, small_corpus):
    text = script.read_text()
    trains = "hpengine train" in text
    n = int(text.split("\nmpiexec -n ")[1].split()[0])
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", OUT=str(tmp_path))
    args = ["--set", f"data.path={small_corpus}"] if trains else []
    p = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    if not trains:
        assert script.stem in EXAMPLE_OUTPUT, f"{script.name}: add what it must print to EXAMPLE_OUTPUT"
        want = EXAMPLE_OUTPUT[script.stem]
        lines = p.stdout.splitlines()
        assert lines[:len(want)] == want, p.stdout
        if script.stem == "08_allreduce_buffers":    # then the CuPy line: skipped without a GPU, else right
            assert len(lines) == len(want) + 1 and lines[-1].startswith("cupy"), p.stdout
            assert lines[-1].startswith("cupy: skipped") or lines[-1].endswith("(expected 3.0: True)"), p.stdout
        else:
            assert len(lines) == len(want), p.stdout
        return
    run = tmp_path / script.stem
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["final_loss"] < summary["first_loss"] - 0.5
    assert f"on {n} ranks" in p.stdout


OMPI_RANK0 = {"PRTE_LAUNCHED": "1", "OMPI_COMM_WORLD_RANK": "0", "PMIX_NAMESPACE": "prterun-node-a-12-4321@1"}


def test_open_mpi_kill_note_names_mpirun_and_the_clean_stop():
    note = launch.open_mpi_kill_note(signal.SIGTERM, OMPI_RANK0)
    assert note.startswith("hpengine: SIGTERM from Open MPI's mpirun") and "kill -USR1 4321" in note
    assert "\n" not in note and "exit 75" in note
    assert "kill -USR1 <pid of mpirun>" in launch.open_mpi_kill_note(signal.SIGINT, {**OMPI_RANK0, "PMIX_NAMESPACE": ""})


@pytest.mark.parametrize("signum, env", [
    (signal.SIGUSR1, OMPI_RANK0),                                  # passed on unchanged: a clean stop follows
    (signal.SIGTERM, {**OMPI_RANK0, "OMPI_COMM_WORLD_RANK": "1"}),   # rank 0 says it once
    (signal.SIGTERM, {"PMI_RANK": "0", "PMI_SIZE": "2"}),            # Hydra forwards SIGTERM: no kill follows
    (signal.SIGTERM, {})])
def test_no_open_mpi_kill_note_elsewhere(signum, env):
    assert launch.open_mpi_kill_note(signum, env) is None
