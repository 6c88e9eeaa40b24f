"""The job scripts' stop under each launcher, without a scheduler: the script runs with the environment a
scheduler gives it (SLURM_NTASKS with LAUNCHER=mpiexec; PBS_NODEFILE and PBS_WALLTIME), SIGTERM goes to the
batch shell (scancel --batch --signal=TERM, qdel, PBS's wall-time kill), the script passes SIGUSR1 on (Open
MPI's mpirun would kill the ranks on SIGTERM), and the job exits 75 with a checkpoint that a second run of
the same script resumes. PBS's own early warning: a timer STOP_BEFORE seconds before PBS_WALLTIME."""
from __future__ import annotations

import shlex
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from venvs import ROOT, env_for, n_lines, steps_of, wait_for

CONFIG = """\
[model]
d_model = 32
seq_len = 16
n_layers = 2
[data]
path = "{corpus}"
[train]
steps = 100000
global_batch = 4
eval_every = 0
log_every = 5
[strategy.sharding]
enable = true
degree = 2
"""
SCRIPTS = {"slurm": ROOT / "jobs" / "slurm_train.sbatch", "pbs": ROOT / "jobs" / "pbs_train.pbs"}


def _job_env(tmp_path, launcher, script, corpus, **extra) -> dict:
    """What a scheduler would give the script, for 2 ranks; the launcher's environment through SETUP_ENV
    (HPENGINE_ROOT is a folder without .venv, so the script activates nothing else)."""
    (tmp_path / "job.toml").write_text(CONFIG.format(corpus=corpus))
    setup = tmp_path / "setup_env.sh"
    setup.write_text(f'export PATH="{env_for(tmp_path, launcher)["PATH"]}"\n')
    nodefile = tmp_path / "nodefile"                 # PBS: one line per slot, the ranks counted from it
    nodefile.write_text(f"{socket.gethostname()}\n" * 2)
    sched = ({"LAUNCHER": "mpiexec", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "my job"}
             if script == "slurm" else {"PBS_NODEFILE": str(nodefile)})
    return env_for(tmp_path, launcher, HPENGINE_ROOT=str(tmp_path), SETUP_ENV=str(setup),
                   CONFIG=str(tmp_path / "job.toml"), OUT_DIR=str(tmp_path / "run"), **sched, **extra)


def _run_script(tmp_path, script, env, log: Path, stop=None):
    """Run the script to its end (after `stop(proc)` once three steps are done, when given); its status."""
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(SCRIPTS[script])], stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_path)
        try:
            if stop:
                wait_for(lambda: n_lines(tmp_path / "run" / "metrics.jsonl") >= 3, proc, "three steps", log)
                stop(proc)
            return proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()


def _check_stopped_and_resume(tmp_path, script, env, log_text: str, rc: int, said: str) -> None:
    assert rc == 75, log_text
    assert said in log_text, log_text
    k = int(log_text.split("SIGUSR1 received: stopping cleanly after step ")[1].split()[0])
    assert "of 100000 (checkpoint saved)" in log_text and "finished with status 75" in log_text, log_text
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == f"step_{k:08d}"
    assert steps_of(tmp_path / "run") == list(range(1, k + 1))
    _check_continue_lines(tmp_path / "run", script, env, log_text)

    again = tmp_path / "again.log"          # the same script again: --resume auto from that checkpoint
    rc = _run_script(tmp_path, script, {**env, "EXTRA_ARGS": f"--set train.steps={k + 2}"}, again)
    text = again.read_text()
    assert rc == 0, text
    assert f"resuming from the latest checkpoint under {root} (step {k})" in text, text
    assert steps_of(tmp_path / "run") == list(range(1, k + 3)), text


def _check_continue_lines(run: Path, script: str, env: dict, log_text: str) -> None:
    """Rank 0's line repeats the launch the script made (2 ranks); the script's own names the job that
    continues the run: the same job name, ranks and launcher on the run's config.toml."""
    lines = [ln.split("continue with: ", 1)[1] for ln in log_text.splitlines() if "continue with: " in ln]
    assert len(lines) == 2, log_text
    engine, job = (lines if "hpengine train" in lines[0] else lines[::-1])
    words = shlex.split(engine)
    assert words[1:] == ["-n", "2", "hpengine", "train", f"{run}/config.toml", "--resume", "auto"], engine
    assert Path(words[0]).name in ("mpiexec", "mpirun"), engine
    if script == "slurm":
        want = ["sbatch", "--job-name=my job", "--nodes=1", "--ntasks=2",
                f"--export=ALL,CONFIG={run}/config.toml,OUT_DIR={run},LAUNCHER=mpiexec,SRUN_MPI=pmi2",
                "jobs/slurm_train.sbatch"]
    else:
        want = ["qsub", "-N", "hpengine", "-v", f"CONFIG={run}/config.toml,OUT_DIR={run},NP=2", "jobs/pbs_train.pbs"]
    assert shlex.split(job) == want, job


@pytest.mark.parametrize("script", ["slurm", "pbs"])
@pytest.mark.parametrize("launcher", ["openmpi", "hydra"])
def test_sigterm_to_the_script_stops_with_a_checkpoint_that_resumes(tmp_path, small_corpus, launcher, script):
    env = _job_env(tmp_path, launcher, script, small_corpus)
    log = tmp_path / "job.log"
    rc = _run_script(tmp_path, script, env, log, stop=lambda p: p.send_signal(signal.SIGTERM))
    said = ("SIGTERM (cancelled or preempted): asking the ranks to stop" if script == "slurm"
            else "SIGTERM (qdel or the wall time): asking the ranks to stop")
    _check_stopped_and_resume(tmp_path, script, env, log.read_text(), rc, said)


def test_pbs_asks_the_ranks_to_stop_before_the_wall_time(tmp_path, small_corpus):
    """No signal from outside: PBS_WALLTIME (Torque's, seconds) less STOP_BEFORE leaves 25 s, then the
    script's own timer sends it SIGUSR1."""
    env = _job_env(tmp_path, "openmpi", "pbs", small_corpus, PBS_WALLTIME="1025", STOP_BEFORE="1000")
    log = tmp_path / "job.log"
    rc = _run_script(tmp_path, "pbs", env, log)
    text = log.read_text()
    assert "wall time 1025 s: the ranks will be asked to stop in" in text, text
    _check_stopped_and_resume(tmp_path, "pbs", env, text, rc, "SIGUSR1 (wall time near, or qsig -s USR1)")
