"""How a run was launched, from the variables each launcher sets (environments written out as the launcher
gives them, not derived from the code), the continue line that repeats that launch, and the one line a resume
under another world size or mesh logs."""
import json
import shlex

import pytest

from hpengine.config import load_config
from hpengine.run import launch
from hpengine.run.resume import layout_change
from hpengine.run.train import continue_command, next_steps

OUT = "/runs/a b"
TAIL = "hpengine train '/runs/a b'/config.toml --resume auto"

# what each launcher puts in rank 0's environment (Hydra: seen under the mpich wheel's mpiexec; Open MPI 5:
# its documented OMPI_COMM_WORLD_* and PRRTE's PRTE_LAUNCHED; srun --mpi=pmi2: SLURM_STEP_* and PMI_*)
HYDRA = {"PMI_RANK": "0", "PMI_SIZE": "4", "PMI_FD": "9", "PMI_HOSTNAME": "vm", "HYDI_CONTROL_FD": "7",
         "MPI_LOCALNRANKS": "4", "MPI_LOCALRANKID": "0"}
OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "PRTE_LAUNCHED": "1", "PMIX_NAMESPACE": "prterun-vm-4242@1", "PMIX_RANK": "0"}
SRUN = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4",
        "SLURM_PROCID": "0", "SLURM_MPI_TYPE": "pmi2", "PMI_SIZE": "4", "PMI_RANK": "0", "PMI_FD": "5"}
# Hydra and Open MPI inside a SLURM allocation start their per-node daemons with srun: the ranks see that
# step (one task per node) as well as their launcher's own variables
HYDRA_IN_SLURM = {**HYDRA, "PMI_SIZE": "8", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": "2"}
OPEN_MPI_IN_SLURM = {**OPEN_MPI, "OMPI_COMM_WORLD_SIZE": "8", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0",
                     "SLURM_STEP_NUM_TASKS": "2"}


@pytest.mark.parametrize("env, want", [
    (HYDRA, f"mpiexec -n 4 {TAIL}"),
    (OPEN_MPI, f"mpirun -n 4 {TAIL}"),
    (SRUN, f"srun --mpi=pmi2 -n 4 {TAIL}"),
    ({**SRUN, "SLURM_MPI_TYPE": "none"}, f"srun -n 4 {TAIL}"),
    (HYDRA_IN_SLURM, f"mpiexec -n 8 {TAIL}"),
    (OPEN_MPI_IN_SLURM, f"mpirun -n 8 {TAIL}"),
    ({"PMI_SIZE": "1", "PMI_RANK": "0", "HYDI_CONTROL_FD": "7", "MPI_LOCALNRANKS": "1"}, f"mpiexec -n 1 {TAIL}"),
    ({}, TAIL),                                                           # no launcher: one process
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4"}, TAIL),                  # python run in the batch shell itself
    ({"PBS_JOBID": "5.pbs", "PBS_NP": "4"}, TAIL),                         # ... or in a qsub job's shell
], ids=["hydra", "openmpi", "srun", "srun-no-mpi-type", "hydra-in-slurm", "openmpi-in-slurm", "hydra-n1",
        "none", "slurm-batch-shell", "pbs-job-shell"])
def test_the_continue_line_repeats_the_launch(env, want):
    assert continue_command(OUT, launch.launched_as(env)) == want
    words = shlex.split(want)
    assert words[words.index("train") + 1] == "/runs/a b/config.toml"       # one word for the shell


def test_the_launch_record_names_launcher_program_and_ranks():
    assert launch.launched_as(HYDRA) == {"launcher": "mpiexec", "program": "mpiexec", "args": [], "ranks": 4}
    assert launch.launched_as(OPEN_MPI) == {"launcher": "mpirun", "program": "mpirun", "args": [], "ranks": 4}
    assert launch.launched_as(SRUN) == {"launcher": "srun", "program": "srun", "args": ["--mpi=pmi2"], "ranks": 4}
    assert launch.launched_as({}) == {"launcher": None, "program": None, "args": [], "ranks": 1}


def test_a_launcher_path_is_quoted_for_the_shell():
    typed = {"launcher": "mpiexec", "program": "/opt/my mpi/bin/mpiexec", "args": [], "ranks": 4}
    line = continue_command(OUT, typed)
    assert line == f"'/opt/my mpi/bin/mpiexec' -n 4 {TAIL}"
    assert shlex.split(line)[:3] == ["/opt/my mpi/bin/mpiexec", "-n", "4"]


def test_the_stopped_runs_last_line_carries_the_launch(tmp_path):
    cfg = load_config(None, [f"train.out_dir={tmp_path / 'run'}"])
    line = next_steps(cfg, tmp_path / "run", "SIGINT", launch.launched_as(HYDRA))
    assert line.endswith(f"continue with: mpiexec -n 4 hpengine train {tmp_path / 'run'}/config.toml --resume auto")


# ---- a resume under another world size or mesh says so ----------------------------------------------------
DEGREES = {"tp": 1, "cp": 1, "sharding": 1, "dp": 1, "pp": 1}


def _saved(tmp_path, world: int, layout: dict, launch_json: dict | None):
    """A run folder whose latest checkpoint was saved by `world` ranks on `layout`, and its launch.json."""
    out = tmp_path / "run"
    step = out / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"step": 4, "world": world, "layout": {**DEGREES, **layout}}))
    (out / "checkpoints" / "latest").write_text("step_00000004")
    if launch_json is not None:
        (out / "launch.json").write_text(json.dumps(launch_json))
    return load_config(None, [f"train.out_dir={out}"])


def _now(env, **mesh):
    return {**launch.launched_as(env), "mesh": {**DEGREES, **mesh}}


def test_resuming_on_fewer_ranks_names_both_launches(tmp_path):
    cfg = _saved(tmp_path, 4, {"dp": 4}, {"launcher": "mpiexec", "program": "mpiexec", "args": [], "ranks": 4})
    line = layout_change(cfg, "latest", _now({}))
    assert line == ("resuming a run launched as mpiexec -n 4 (mesh dp=4) on 1 rank (no parallel axes): the layout "
                    "changes, the training does not (the same global batches, the same result as one process up "
                    "to rounding)")
    root = str(tmp_path / "run" / "checkpoints")        # --resume auto hands on the checkpoints root
    assert layout_change(cfg, root, _now(SRUN, pp=2, tp=2)).startswith(
        "resuming a run launched as mpiexec -n 4 (mesh dp=4) under srun --mpi=pmi2 -n 4 (mesh pp=2 x tp=2): ")


def test_the_same_layout_says_nothing_and_an_unrelated_launch_json_is_not_named(tmp_path):
    cfg = _saved(tmp_path, 4, {"dp": 4}, {"launcher": "mpiexec", "program": "mpiexec", "args": [], "ranks": 2})
    assert layout_change(cfg, "latest", _now(HYDRA, dp=4)) is None
    # launch.json is of a later launch on 2 ranks that saved nothing: the checkpoint's own facts only
    assert layout_change(cfg, "latest", _now({})).startswith("resuming a run launched on 4 ranks (mesh dp=4) on 1 "
                                                             "rank (no parallel axes): ")


def test_a_resume_into_or_out_of_diloco_islands_says_the_training_changes(tmp_path):
    cfg = _saved(tmp_path, 4, {"dp": 4}, None)
    cfg.strategy.diloco.inner_steps = 50
    line = layout_change(cfg, "latest", _now({}, replica=4))
    assert line.endswith(": from here on 4 DiLoCo islands meet every 50 steps: the training is no longer one "
                         "process's"), line
