"""The continue line repeats the launch: a 4-rank run under Hydra's mpiexec stopped with Ctrl-C (SIGINT to
mpiexec) ends with `continue with: <that mpiexec> -n 4 hpengine train RUN/config.toml --resume auto`; that
line, split as a shell would and run verbatim, resumes on 4 ranks; a resume on one process says in one line
that the layout changed."""
from __future__ import annotations

import json
import shlex
import signal
import subprocess
from pathlib import Path

from venvs import TINY, bin_of, env_for, sets, steps_of, wait_for

STEPS = 100000          # never reached: every run here is stopped


def _stop_after(argv, env, cwd, log: Path, run: Path, rows: int) -> tuple[int, str]:
    """Run argv until metrics.jsonl has `rows` rows and a checkpoint exists, then SIGINT the launcher (what
    Ctrl-C in its terminal does); its status and output."""
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            wait_for(lambda: len(_rows(run)) >= rows and (run / "checkpoints" / "latest").exists(), proc,
                     f"{rows} steps and a checkpoint", log)
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return rc, log.read_text(errors="replace")


def _rows(run: Path) -> list:
    try:
        return steps_of(run)
    except (OSError, ValueError):
        return []


def _continue_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if "continue with: " in ln]
    assert len(lines) == 1, text[-3000:]
    return lines[0].split("continue with: ", 1)[1]


def _latest_step(run: Path) -> int:
    return int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])


def test_a_stopped_4_rank_run_continues_on_4_ranks_with_its_own_line(tmp_path, small_corpus):
    b = bin_of("hydra")
    env = env_for(tmp_path, "hydra")
    run = tmp_path / "run"
    mpiexec = str(b / "mpiexec")
    first = [mpiexec, "-n", "4", "hpengine", "train",
             *sets(*TINY, f"data.path={small_corpus}", f"train.out_dir={run}", f"train.steps={STEPS}",
                   "train.log_every=1", "checkpoint.every=2", "strategy.data_parallel.enable=true")]
    rc, text = _stop_after(first, env, tmp_path, tmp_path / "first.log", run, 3)
    assert rc == 130, text[-3000:]
    cont = _continue_line(text)
    assert cont == f"{shlex.quote(mpiexec)} -n 4 hpengine train {shlex.quote(str(run))}/config.toml --resume auto"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["continue"] == cont and summary["stopped_early"] == "SIGINT"
    record = json.loads((run / "launch.json").read_text())
    assert (record["launcher"], record["program"], record["ranks"]) == ("mpiexec", mpiexec, 4)
    assert record["mesh"]["dp"] == 4 and record["command"] == f"{shlex.quote(mpiexec)} -n 4"
    assert summary["launch"] == record

    k = _latest_step(run)            # the line, verbatim: 4 ranks again, from that checkpoint
    rc, text = _stop_after(shlex.split(cont), env, tmp_path, tmp_path / "again.log", run, k + 2)
    assert rc == 130, text[-3000:]
    assert f"--resume auto: resuming from the latest checkpoint under {run / 'checkpoints'} (step {k})" in text, text
    assert "on 4 ranks" in next(ln for ln in text.splitlines() if "] mesh " in ln), text
    assert len((run / "ranks.jsonl").read_text().splitlines()) == 4
    assert "resuming a run launched" not in text, text             # the same layout: nothing to say
    assert _continue_line(text) == cont
    assert json.loads((run / "summary.json").read_text())["launch"]["ranks"] == 4

    k = _latest_step(run)            # one process instead: the layout changes, said once
    one = subprocess.run(["hpengine", "train", f"{run}/config.toml", "--resume", "auto", "--set",
                          f"train.steps={k + 1}"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    said = [ln for ln in one.stdout.splitlines() if "resuming a run launched" in ln]
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert len(said) == 1 and said[0].split("] ", 1)[1].startswith(
        f"resuming a run launched as {mpiexec} -n 4 (mesh dp=4) on 1 rank (no parallel axes): the layout changes"), \
        one.stdout[-3000:]
    assert json.loads((run / "launch.json").read_text())["launcher"] is None
