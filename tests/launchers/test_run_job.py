"""venvs.run_job starts a job once more only when mpirun's own start-up failed, with its output captured or in a log."""
from __future__ import annotations

from venvs import STARTUP_FAILURE, run_job


def _job(tmp_path, fail_with: str, times: int):
    """A job that prints fail_with and exits 213 its first `times` runs, then succeeds; counts its runs."""
    n = tmp_path / "runs"
    return n, ["bash", "-c", f'r=$(cat {n} 2>/dev/null || echo 0); echo $((r + 1)) > {n}; '
                             f'[ "$r" -ge {times} ] && echo ok && exit 0; echo "{fail_with}"; exit 213']


def test_a_failed_start_up_runs_once_more(tmp_path):
    n, argv = _job(tmp_path, STARTUP_FAILURE, 1)
    res = run_job(argv, capture_output=True, text=True, check=False)
    assert res.returncode == 0 and "ok" in res.stdout and n.read_text().strip() == "2"
    n.unlink()
    log = tmp_path / "job.log"
    assert run_job(argv, log, check=False).returncode == 0 and log.read_text() == "ok\n"


def test_other_failures_and_a_second_start_up_failure_stand(tmp_path):
    n, argv = _job(tmp_path, "a rank failed", 1)
    assert run_job(argv, capture_output=True, text=True, check=False).returncode == 213
    assert n.read_text().strip() == "1"
    n.unlink()
    n, argv = _job(tmp_path, STARTUP_FAILURE, 2)
    res = run_job(argv, capture_output=True, text=True, check=False)
    assert res.returncode == 213 and STARTUP_FAILURE in res.stdout and n.read_text().strip() == "2"
