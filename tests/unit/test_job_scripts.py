"""The job scripts without a scheduler: bash syntax, shellcheck (when installed), and setup_env running with
`set -u` off (conda's activation scripts read unset variables), so the first problem reported is the real one."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[2] / "jobs"
SCRIPTS = [JOBS / "slurm_train.sbatch", JOBS / "pbs_train.pbs", JOBS / "pbspro_train.pbs"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (make test-unit installs it where apt-get is usable as root)")
def test_shellcheck_is_clean():
    p = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("script", SCRIPTS[:2], ids=lambda p: p.name)
def test_setup_env_may_read_unset_variables(script, tmp_path):
    """A SETUP_ENV file like conda's activate (reads an unset variable) must not stop the job; the run
    then fails on the missing config, the first real problem, before anything is launched."""
    env_file = tmp_path / "activate.sh"
    env_file.write_text('if [ -n "$HPE_SURELY_UNSET_VARIABLE" ]; then :; fi\nexport HPE_SETUP_RAN=1\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    env.update(SETUP_ENV=str(env_file), CONFIG=str(tmp_path / "missing.toml"), HPENGINE_ROOT=str(tmp_path), NP="1")
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert "unbound variable" not in p.stderr, p.stderr
    assert p.returncode == 2 and f"config '{tmp_path / 'missing.toml'}' not found" in p.stderr, p.stderr



LOCAL_NODE = JOBS / "local_node.sh"      # the ssh stand-in of tests/nodes (two nodes on one machine)


def test_local_node_script_is_posix_sh_and_shellcheck_clean():
    p = subprocess.run(["sh", "-n", str(LOCAL_NODE)], check=False, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (make test-unit installs it where apt-get is usable as root)")
    p = subprocess.run(["shellcheck", str(LOCAL_NODE)], check=False, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("args, said", [([], "usage: local_node.sh [ssh options] HOST COMMAND"),
                                        (["-x", "nodeA"], "usage:"),
                                        (["-o", "BatchMode=yes", "no de", "true"], "host 'no de' is not a host name")])
def test_local_node_refuses_bad_arguments_in_one_line(args, said):
    """Its arguments are checked before it needs root."""
    p = subprocess.run(["sh", str(LOCAL_NODE), *args], check=False, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and said in p.stderr, p.stderr
