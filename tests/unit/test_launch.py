"""Launch behaviour under real mpiexec: a failing rank ends the job fast; bad degrees give one clear
error on every rank and a non-zero exit, never a hang."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
MPIEXEC = BIN / "mpiexec"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec from the mpich wheel not installed")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(args, timeout=60):
    t = time.perf_counter()
    p = subprocess.run([str(MPIEXEC), *args], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)
    return p, time.perf_counter() - t


def test_failing_rank_aborts_job_quickly():
    p, dt = _run(["-n", "2", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                  "tests/mpi/deliberate_failure.py"])
    assert p.returncode != 0
    assert "deliberate failure" in p.stdout + p.stderr
    assert dt < 30, f"took {dt:.1f} s"


def test_degrees_not_matching_world_fail_on_every_rank_with_one_line(tmp_path):
    p, dt = _run(["-n", "2", str(BIN / "hpengine"), "train", "--set", "strategy.sharding.enable=true",
                  "--set", "strategy.sharding.degree=3", "--set", f"train.out_dir={tmp_path}/r"])
    assert p.returncode != 0 and dt < 30
    # both ranks fail with the same line: the job prints it once
    assert p.stderr.count("hpengine: error:") == 1
    msg = "multiply to 3 but the world size is 2"
    assert p.stderr.count(msg) == 1 and "sharding=3" in p.stderr
    assert "Traceback" not in p.stderr


def test_batch_not_divisible_by_replicas(tmp_path):
    p, _ = _run(["-n", "2", str(BIN / "hpengine"), "train", "--set", "strategy.data_parallel.enable=true",
                 "--set", "train.global_batch=3", "--set", f"train.out_dir={tmp_path}/r"])
    assert p.returncode != 0
    assert "train.global_batch = 3 is not divisible by dp x sharding" in p.stderr
