"""An error every rank agrees on is printed once per job, not once per rank (the real launcher: the mpich
wheel's Hydra mpiexec, two ranks)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = Path(sys.executable).parent / "mpiexec"
pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec from the mpich wheel not installed")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ROOT = str(Path(__file__).resolve().parents[2])


def _job(tmp_path, n, *sets):
    args = [a for s in (*sets, f"train.out_dir={tmp_path / 'run'}") for a in ("--set", s)]
    env = {**ENV, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [ENV.get("PYTHONPATH")])])}
    return subprocess.run([str(MPIEXEC), "-genv", "PYTHONPATH", env["PYTHONPATH"], "-n", str(n), sys.executable,
                           "-m", "hpengine", "train", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("sets, expect", [
    (("model.d_model=-1",), "hpengine: error: model.d_model = -1: must be >= 1"),
    (("strategy.tensor_parallel.enable=true", "strategy.tensor_parallel.degree=3"), "hpengine: error: "),
])
def test_an_error_every_rank_has_is_printed_once(tmp_path, sets, expect):
    p = _job(tmp_path, 2, *sets)
    lines = [x for x in p.stderr.splitlines() if "error:" in x]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(expect) and "rank" not in lines[0].split("error:")[0], lines
