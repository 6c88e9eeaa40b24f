"""A throw-away single-node SLURM for the cluster tests: munged, slurmctld and slurmd started from a
slurm.conf in a private folder (own ports, state, logs, munge socket), stopped again by pid. Needs
Debian's slurm-wlm, slurmctld, slurmd, slurm-client, munge (and slurm-wlm-torque for #PBS scripts).
"""
from __future__ import annotations

import ctypes
import getpass
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "srun")
SLURM_CONF = """\
ClusterName=hpetest
FirstJobId={first_job}
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=600
NodeName={host} CPUs={cpus} SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore={threads} RealMemory=1000
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def missing_tools() -> list[str]:
    """Programs this cluster needs that are not installed (looked up on PATH and in /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [t for t in DAEMONS + CLIENTS if shutil.which(t, path=path) is None]


def _die_with_parent():
    """Linux: the daemon gets SIGTERM when the test process dies, even if it is killed (no teardown)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """Start with up(); env() is what client commands (sbatch, scontrol) need; down() stops our daemons."""

    def __init__(self, folder: Path, cpus: int = 4):
        self.dir = Path(folder)
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus
        self.conf = self.dir / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _start(self, name, args):
        exe = shutil.which(name, path="/usr/sbin:/sbin:" + os.environ.get("PATH", ""))
        log = open(self.dir / f"{name}.stdout", "w")
        self.procs[name] = subprocess.Popen([exe, *args], stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                            start_new_session=True, preexec_fn=_die_with_parent)

    def up(self, timeout: float = 60) -> "SlurmCluster":
        for sub in ("state", "spool", "munge"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(SLURM_CONF.format(host=self.host, ctld_port=_free_port(), d_port=_free_port(),
                                               dir=self.dir, cpus=self.cpus, threads=max(1, self.cpus // 2),
                                               user=getpass.getuser(), first_job=random.randrange(10**5, 10**7)))
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._start("munged", ["--foreground", "--force", f"--socket={self.dir}/munge.sock",
                               f"--key-file={key}", f"--pid-file={self.dir}/munge/munged.pid",
                               f"--log-file={self.dir}/munge/munged.log", f"--seed-file={self.dir}/munge/seed"])
        self._wait(lambda: (self.dir / "munge.sock").exists(), timeout, "munged socket")
        self._start("slurmctld", ["-D", "-i", "-f", str(self.conf)])
        self._start("slurmd", ["-D", "-f", str(self.conf)])
        self._wait(self._node_idle, timeout, f"node {self.host} idle")
        return self

    def _node_idle(self) -> bool:
        p = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=self.env())
        return p.returncode == 0 and p.stdout.strip() in ("idle", "mix", "alloc")

    def _wait(self, ok, timeout, what):
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0]} exited while waiting for {what}: {self.logs()}")
            if ok():
                return
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}: {self.logs()}")

    def logs(self) -> str:
        out = []
        for f in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.stdout")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)

    def down(self) -> None:
        """Cancel what is still queued or running, then stop the daemons this object started (by pid)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--partition=debug"], env=self.env(), capture_output=True)
            t_end = time.monotonic() + 30
            while time.monotonic() < t_end and subprocess.run(
                    ["squeue", "-h"], capture_output=True, text=True, env=self.env()).stdout.strip():
                time.sleep(0.5)
        for name in reversed(list(self.procs)):
            p = self.procs.pop(name)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()

    def submit(self, script, *args, cwd=None, env=None) -> str:
        p = subprocess.run(["sbatch", "--parsable", *args, str(script)], capture_output=True, text=True,
                           cwd=cwd, env={**self.env(), **(env or {})})
        if p.returncode:
            raise RuntimeError(f"sbatch failed: {p.stderr.strip()}")
        return p.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> dict:
        p = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                           env=self.env())
        fields = dict(kv.split("=", 1) for kv in p.stdout.split() if "=" in kv)
        return fields

    def wait(self, job_id: str, timeout: float = 300) -> dict:
        """Poll `scontrol show job` until the job has ended; returns its fields."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            st = self.job_state(job_id)
            if st.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                                      "PREEMPTED", "BOOT_FAIL", "DEADLINE"):
                return st
            time.sleep(0.5)
        subprocess.run(["scancel", job_id], env=self.env())
        raise RuntimeError(f"job {job_id} still {self.job_state(job_id).get('JobState')} after {timeout} s")
