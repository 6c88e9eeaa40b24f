"""jobs/slurm_train.sbatch stopped before its end on a real single-node SLURM. SIGUSR1 to the batch shell
(what --signal=B:USR1@120 sends before the wall time; `scancel --batch --signal=USR1` sends it now): the
ranks save and exit 75, the script requeues the job, the same job id runs again in the same run folder
(fixed by job name) with --resume auto, and ends with the loss of an uninterrupted run. SIGTERM (scancel,
preemption): exit 75, not requeued, and SLURM records ExitCode 75.

SLURM 22.05 holds a requeued job for about two minutes (Reason=BeginTime); the test moves its start time
to now with `scontrol update` (once the first start's step is cleaned up), to keep the test short."""
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_slurm import ROOT, SBATCH, cluster, config, pytestmark  # noqa: E402,F401 (fixtures, skip mark)

STEPS = 60


def _submit(cluster, config, tmp_path, name, *extra):
    out = tmp_path / f"{name}.out"
    env = f"--export=ALL,CONFIG={config},RUNS_ROOT={tmp_path},EXTRA_ARGS=--set train.steps={STEPS}"
    return cluster.submit(SBATCH, env, f"--job-name={name}", f"--output={out}", *extra, cwd=ROOT), out


def _signal_after(cluster, job, out, metrics: Path, n: int, sig: str) -> None:
    """Send `sig` to the batch shell once `n` steps are in metrics.jsonl."""
    t_end = time.monotonic() + 120
    while not metrics.exists() or metrics.read_text().count("\n") < n:
        assert time.monotonic() < t_end, out.read_text() if out.exists() else "the job never started"
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", f"--signal={sig}", job], check=True, env=cluster.env())


def _wait_step_gone(cluster, job) -> None:
    """Until the first start's step has been cleaned up on the node: its slurmstepd, finishing after the
    job was requeued, removes the pmi2 socket named by job and step id, which a second start of the
    same step id within a second would already be using (SLURM's own two-minute hold rules that out)."""
    log, t_end = cluster.dir / "slurmd.log", time.monotonic() + 60
    while f"[{job}.0] done with job" not in log.read_text(errors="replace"):
        assert time.monotonic() < t_end, cluster.logs()
        time.sleep(0.2)


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_usr1_stops_requeues_and_resumes_to_the_same_loss(cluster, config, tmp_path):
    ref_job, ref_out = _submit(cluster, config, tmp_path, "straight")
    job, out = _submit(cluster, config, tmp_path, "preempted")      # starts when the reference is done
    try:
        ref = cluster.wait(ref_job, timeout=120)
        assert ref["JobState"] == "COMPLETED" and ref["Restarts"] == "0", ref_out.read_text()
        _signal_after(cluster, job, out, tmp_path / "preempted" / "metrics.jsonl", 10, "USR1")
        t_end = time.monotonic() + 60
        # requeued: same id, pending; slurmctld may show it COMPLETING for a moment while the script ends
        while (st := cluster.job_state(job)).get("JobState") != "PENDING":
            assert st.get("JobState") in ("RUNNING", "COMPLETING") and time.monotonic() < t_end, (st, out.read_text())
            time.sleep(0.2)
        t_end = time.monotonic() + 10        # slurmctld may show the requeued job pending a moment before
        while st.get("Reason") == "None" and time.monotonic() < t_end:     # it records the BeginTime hold
            time.sleep(0.2)
            st = cluster.job_state(job)
        assert st["Restarts"] == "1" and st["Reason"] == "BeginTime", st
        _wait_step_gone(cluster, job)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, env=cluster.env())
        st = cluster.wait(job, timeout=120)
    finally:
        subprocess.run(["scancel", job], env=cluster.env(), capture_output=True)
    text = out.read_text()
    assert (st["JobState"], st["ExitCode"], st["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    run, straight = tmp_path / "preempted", tmp_path / "straight"
    first, second = text.split("(start 2)")
    assert f"hpengine job {job} (start 1)" in first and f"run folder {run};" in first
    assert "SIGUSR1 (wall time near): asking the ranks to stop" in first
    k = int(first.split("SIGUSR1 received: stopping cleanly after step ")[1].split()[0])
    assert 10 <= k < STEPS and f"of {STEPS} (checkpoint saved)" in first
    assert "finished with status 75" in first and f"requeueing job {job} to resume from {run}/checkpoints" in first
    assert f"--resume auto: resuming from the latest checkpoint under {run / 'checkpoints'} (step {k})" in second
    assert "finished with status 0" in second and "requeueing" not in second
    final = json.loads((run / "summary.json").read_text())
    assert final["stopped_early"] is None
    assert final["final_loss"] == json.loads((straight / "summary.json").read_text())["final_loss"]
    assert len(_losses(run)) == STEPS and _losses(run) == _losses(straight)    # every step once, bit-exact


def test_sigterm_stop_is_not_requeued_and_ends_with_75(cluster, config, tmp_path):
    job, out = _submit(cluster, config, tmp_path, "stopped")
    try:
        _signal_after(cluster, job, out, tmp_path / "stopped" / "metrics.jsonl", 3, "TERM")
        st = cluster.wait(job, timeout=120)
    finally:
        subprocess.run(["scancel", job], env=cluster.env(), capture_output=True)
    text = out.read_text()
    assert (st["JobState"], st["ExitCode"], st["Restarts"]) == ("FAILED", "75:0", "0"), text
    assert "SIGTERM (cancelled or preempted): asking the ranks to stop" in text
    assert "finished with status 75" in text and "stopped early by SIGTERM: not requeued" in text
    assert json.loads((tmp_path / "stopped" / "summary.json").read_text())["stopped_early"] == "SIGTERM"
