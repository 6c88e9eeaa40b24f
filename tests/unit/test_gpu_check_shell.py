"""benchmarks/gpu_check.sh without a GPU: its syntax, shellcheck, its MPI handling (smoke skip, wheel
install, network-module retry), the parts' deadline it passes on (what a 10-minute total leaves after the
setup) and its backstop timeout, and the hand-off to gpu_check.py, against a fake interpreter."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHELL = ROOT / "benchmarks" / "gpu_check.sh"


def test_shell_syntax_and_shellcheck():
    p = subprocess.run(["bash", "-n", str(SHELL)], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (make test-unit installs it where apt-get is usable as root)")
    # SC2163: `export $opts` exports the NAME=value words of one of mpi_world2's option strings on purpose
    # (test_shell_retries_mpi_network_modules_and_exports_the_one_that_works checks that it does)
    p = subprocess.run(["shellcheck", "--exclude=SC2163", str(SHELL)], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stdout + p.stderr


FAKE_PYTHON = r"""#!/usr/bin/env bash
# stands in for the interpreter: answers the wrapper's probes, "installs" MPICH, records the gpu_check.py call
F=@FAKE@
if [ "$1" = -c ]; then
  case "$2" in
    *sysconfig*) echo "$F/data" ;;
    *sys.version*) echo 3.12.0 ;;
    *Get_library_version*)
      [ -e "$F/installed" ] || { echo "ModuleNotFoundError: No module named 'mpi4py'"; exit 1; }
      echo "MPICH Version: 5.0.2" ;;
    *Barrier*) : ;;
    *) exit 9 ;;
  esac
  exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
  printf '%s\0' "$@" > "$F/pip.args"
  mkdir -p "$F/data/bin" && cp "$F/mpiexec" "$F/data/bin/mpiexec" && touch "$F/installed"
  exit 0
fi
if [ "$1" = benchmarks/gpu_check.py ]; then
  printf '%s\0' "$@" > "$F/gpu_check.args"
  printf '%s\0' "PWD=$PWD" "PYTHONPATH=$PYTHONPATH" "MPICH_CH4_NETMOD=${MPICH_CH4_NETMOD:-}" \
    "FI_PROVIDER=${FI_PROVIDER:-}" > "$F/gpu_check.env"
  exit 3
fi
exit 9
"""
# a 2-rank world comes up only over OFI's tcp provider (as when the default network module fails)
FAKE_MPIEXEC = r"""#!/usr/bin/env bash
echo "${MPICH_CH4_NETMOD:-default}/${FI_PROVIDER:-default}" >> @FAKE@/mpiexec.calls
[ "${MPICH_CH4_NETMOD:-}" = ofi ] && [ "${FI_PROVIDER:-}" = tcp ] || exit 1
shift 2
exec "$@"
"""
FAKE_TIMEOUT = r"""#!/usr/bin/env bash
mkdir -p @FAKE@/timeout.d
printf '%s\0' "$@" > "@FAKE@/timeout.d/$(ls @FAKE@/timeout.d | wc -l)"
exec @TIMEOUT@ "$@"
"""


def _nul_list(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def _run_wrapper(tmp_path, *args, wheel=False):
    """benchmarks/gpu_check.sh copied into a bare tree (no benchmarks/wheels, no .whl) with a fake
    interpreter at .venv/bin/python, fake mpiexec and a recording timeout first on PATH. Returns (the
    process, the fake's folder)."""
    if shutil.which("timeout") is None:
        pytest.skip("needs coreutils' timeout")
    root, fake, stubs = tmp_path / "tree", tmp_path / "fake", tmp_path / "stubs"
    for d in (root / "benchmarks", root / ".venv" / "bin", fake / "wheels", stubs):
        d.mkdir(parents=True)
    shutil.copy(SHELL, root / "benchmarks" / "gpu_check.sh")
    for path, text in ((root / ".venv" / "bin" / "python", FAKE_PYTHON), (fake / "mpiexec", FAKE_MPIEXEC),
                       (stubs / "mpiexec", FAKE_MPIEXEC), (stubs / "timeout", FAKE_TIMEOUT)):
        path.write_text(text.replace("@FAKE@", str(fake)).replace("@TIMEOUT@", shutil.which("timeout")))
        path.chmod(0o755)
    if wheel:
        (fake / "wheels" / "mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl").write_bytes(b"")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHON", "MPIEXEC", "PYTHONPATH", "MPICH_CH4_NETMOD", "FI_PROVIDER", "HPENGINE_MPICH_PREFIX")}
    env.update(PATH=f"{stubs}:{os.environ['PATH']}", GPU_CHECK_WHEELS=str(fake / "wheels"))
    p = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh"), *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    return p, fake


def _backstop(fake: Path, root: Path) -> list[str]:
    """The arguments of the last timeout call (the one around gpu_check.py), checked to be that call."""
    calls = sorted((fake / "timeout.d").iterdir(), key=lambda f: int(f.name))
    args = _nul_list(calls[-1])
    assert args[:2] == ["-k", args[1]] and args[3:5] == [str(root / ".venv" / "bin" / "python"),
                                                         "benchmarks/gpu_check.py"], args
    return args


def test_shell_smoke_without_mpi_skips_two_ranks_and_passes_everything_on(tmp_path):
    """--cpu-smoke where mpi4py does not import: no install attempt, gpu_check.py run by the tree's
    .venv/bin/python from the tree's root with the tree first on PYTHONPATH, every argument passed on after
    an empty --mpiexec, under a timeout whose kill lands after gpu_check.py's own deadline and within 8
    minutes; the wrapper exits with gpu_check.py's status."""
    p, fake = _run_wrapper(tmp_path, "--cpu-smoke", "--deadline-s", "5", "--parts", "bandwidth")
    root = tmp_path / "tree"
    assert p.returncode == 3, p.stdout + p.stderr
    assert "the smoke run skips the 2-rank part" in p.stdout and "installing MPICH" not in p.stdout
    assert not (fake / "pip.args").exists() and not (fake / "mpiexec.calls").exists()
    assert _nul_list(fake / "gpu_check.args") == ["benchmarks/gpu_check.py", "--mpiexec", "", "--cpu-smoke",
                                                  "--deadline-s", "5", "--parts", "bandwidth"]
    env = dict(kv.split("=", 1) for kv in _nul_list(fake / "gpu_check.env"))
    assert env["PWD"] == str(root) and env["PYTHONPATH"].split(":")[0] == str(root)
    args = _backstop(fake, root)
    kill, limit = int(args[1]), int(args[2])
    assert limit == 5 + 20 and kill == 10           # 20 s after the deadline given, killed 10 s later


def _deadline_arg(args: list[str]) -> int:
    return int(args[args.index("--deadline-s") + 1])


def test_shell_without_mpi_or_wheel_says_what_to_carry(tmp_path):
    """A GPU run (no --cpu-smoke) where MPI does not work and no wheel is found: it says to carry
    benchmarks/wheels, installs nothing and still runs gpu_check.py, with no mpiexec."""
    p, fake = _run_wrapper(tmp_path, "--parts", "tests")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "MPI not usable as found" in p.stdout and "carry benchmarks/wheels" in p.stdout
    assert not (fake / "pip.args").exists()
    args = _nul_list(fake / "gpu_check.args")
    assert args[:3] == ["benchmarks/gpu_check.py", "--mpiexec", ""] and args[-2:] == ["--parts", "tests"]
    # no --deadline-s given: the parts get what the 570 s total leaves after the setup, less 30 s, and the
    # backstop lands 20 s after that deadline, killing 10 s later: the whole run within 10 minutes
    deadline = _deadline_arg(args)
    assert 500 <= deadline <= 540 and f"parts deadline {deadline} s" in p.stdout
    back = _backstop(fake, tmp_path / "tree")
    assert int(back[2]) == deadline + 20 and int(back[1]) == 10
    assert 540 - deadline + int(back[2]) + int(back[1]) <= 600


def test_shell_installs_the_wheel_and_retries_mpi_network_modules(tmp_path):
    """MPI missing and a wheel in $GPU_CHECK_WHEELS: pip installs it offline from there; the installed
    mpiexec (in the interpreter's data folder) fails its 2-rank world with the default network module and
    works with OFI over tcp, which the wrapper exports to gpu_check.py along with that mpiexec."""
    p, fake = _run_wrapper(tmp_path, "--parts", "dp2", wheel=True)
    assert p.returncode == 3, p.stdout + p.stderr
    pip = _nul_list(fake / "pip.args")
    assert pip[:3] == ["-m", "pip", "install"] and pip[-1] == "mpich" and "--no-index" in pip
    assert pip[pip.index("--find-links") + 1] == str(fake / "wheels")
    assert (fake / "mpiexec.calls").read_text().split() == ["default/default", "ofi/tcp"]
    assert "MPI works with MPICH_CH4_NETMOD=ofi FI_PROVIDER=tcp" in p.stdout
    mpx = str(fake / "data" / "bin" / "mpiexec")
    assert f"MPI: MPICH Version: 5.0.2; mpiexec {mpx}" in p.stdout
    args = _nul_list(fake / "gpu_check.args")
    assert args[:3] == ["benchmarks/gpu_check.py", "--mpiexec", mpx] and args[-2:] == ["--parts", "dp2"]
    assert _deadline_arg(args) <= 540
    env = dict(kv.split("=", 1) for kv in _nul_list(fake / "gpu_check.env"))
    assert (env["MPICH_CH4_NETMOD"], env["FI_PROVIDER"]) == ("ofi", "tcp")
