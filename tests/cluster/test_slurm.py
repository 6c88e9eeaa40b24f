"""The job scripts on a real single-node SLURM (started here, stopped afterwards): jobs/slurm_train.sbatch
with srun --mpi=pmi2 and with mpiexec, jobs/pbs_train.pbs (and pbspro_train.pbs) through sbatch's #PBS
support and the qsub wrapper, and the clear failures (wrong srun --mpi, missing config, more ranks than the mesh uses).
Stopping before the wall time, requeue and resume: test_slurm_requeue.py. Skips when SLURM is not installed
(Debian: slurm-wlm slurmctld slurmd slurm-client munge slurm-wlm-torque)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from slurm_cluster import SlurmCluster, missing_tools  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SBATCH, PBS = ROOT / "jobs" / "slurm_train.sbatch", ROOT / "jobs" / "pbs_train.pbs"
PBSPRO = ROOT / "jobs" / "pbspro_train.pbs"       # select=1:ncpus=4:mpiprocs=4, runs pbs_train.pbs
pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"SLURM not installed (missing {missing_tools()}); "
                                "apt-get install slurm-wlm slurmctld slurmd slurm-client munge slurm-wlm-torque")
CONFIG = """\
[model]
d_model = 32
seq_len = 16
[data]
path = "{corpus}"
[train]
steps = 20
eval_every = 0
log_every = 5
[optim]
warmup_steps = 2
[strategy.data_parallel]
enable = true
[strategy.sharding]
enable = true
degree = 2
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.up(timeout=60)
    except RuntimeError as e:
        c.down()
        pytest.fail(f"single-node SLURM did not start: {e}")
    yield c
    c.down()


@pytest.fixture(scope="module")
def config(tmp_path_factory, small_corpus):
    path = tmp_path_factory.mktemp("cfg") / "tiny.toml"
    path.write_text(CONFIG.format(corpus=small_corpus))
    return path


def _sbatch(cluster, script, tmp_path, name, **env):
    """Submit like a user (from the checkout), wait for the end; returns (state fields, output text)."""
    exports = ",".join(["ALL", *(f"{k}={v}" for k, v in env.items())])
    out = tmp_path / f"{name}.out"
    job = cluster.submit(script, f"--export={exports}", f"--output={out}", cwd=ROOT)
    st = cluster.wait(job, timeout=240)
    return st, out.read_text() if out.exists() else f"(no output file {out})\n{cluster.logs()}"


def _check_trained(st, text, run: Path, ranks=4):
    assert st["JobState"] == "COMPLETED", text
    assert f"on {ranks} ranks" in text and f"run folder {run}" in text
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["final_loss"] < summary["first_loss"] - 0.5
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 20 and (run / "config.toml").exists()


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_slurm_script_trains_on_all_tasks(cluster, config, tmp_path, launcher):
    run = tmp_path / "run"
    st, text = _sbatch(cluster, SBATCH, tmp_path, launcher, CONFIG=config, OUT_DIR=run, LAUNCHER=launcher)
    _check_trained(st, text, run)
    assert st["NumTasks"] == "4" and st["TimeLimit"] == "00:30:00"
    assert ("srun --mpi=pmi2" if launcher == "srun" else "bin/mpiexec -n 4") in text


@pytest.mark.parametrize("script", [PBS, PBSPRO], ids=["torque", "pbspro"])
def test_pbs_script_under_sbatch_reads_pbs_lines(cluster, config, tmp_path, script):
    run = tmp_path / "run"
    st, text = _sbatch(cluster, script, tmp_path, "pbs", CONFIG=config, OUT_DIR=run)
    _check_trained(st, text, run)
    assert st["NumTasks"] == "4" and st["TimeLimit"] == "00:30:00" and st["JobName"] == "hpengine"


@pytest.mark.skipif(shutil.which("qsub") is None, reason="slurm-wlm-torque (qsub wrapper) not installed")
def test_pbs_script_through_qsub_wrapper(cluster, config, tmp_path):
    run, out = tmp_path / "run", tmp_path / "qsub.out"
    p = subprocess.run(["qsub", "-v", f"CONFIG={config},OUT_DIR={run}", "-o", str(out), "-e", str(out), str(PBS)],
                       capture_output=True, text=True, cwd=ROOT, env=cluster.env())
    assert p.returncode == 0, p.stdout + p.stderr
    st = cluster.wait(p.stdout.strip().split(".")[0], timeout=240)
    _check_trained(st, out.read_text(), run)


def test_wrong_srun_mpi_type_is_one_clear_error(cluster, config, tmp_path):
    st, text = _sbatch(cluster, SBATCH, tmp_path, "wrong", CONFIG=config, OUT_DIR=tmp_path / "run", SRUN_MPI="none")
    # every rank exits 2 with the error; srun --kill-on-bad-exit may terminate the slower ones first,
    # and then the step's status is their SIGTERM (143) rather than 2: both are this failure
    assert st["JobState"] == "FAILED" and st["ExitCode"].split(":")[0] in ("2", "143"), text
    assert "hpengine: error: the launcher asked for 4 ranks (SLURM_STEP_NUM_TASKS=4" in text
    assert "every task runs alone as rank 0 of 1" in text and "Traceback" not in text
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_missing_config_is_named_in_the_output(cluster, tmp_path):
    st, text = _sbatch(cluster, SBATCH, tmp_path, "nocfg", CONFIG=tmp_path / "nope.toml", OUT_DIR=tmp_path / "run")
    assert st["JobState"] == "FAILED", text
    assert f"hpengine job: error: config '{tmp_path / 'nope.toml'}' not found on" in text


def test_more_ranks_than_the_mesh_uses_is_named(cluster, config, tmp_path):
    st, text = _sbatch(cluster, SBATCH, tmp_path, "mesh", CONFIG=config, OUT_DIR=tmp_path / "run",
                       EXTRA_ARGS="--set strategy.data_parallel.degree=1")
    assert st["JobState"] == "FAILED", text
    assert "multiply to 2 but the world size is 4" in text and "Traceback" not in text
