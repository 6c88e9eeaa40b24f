"""The rank supervisor: under an MPI launcher `hpengine train` forks before MPI starts; the child is the rank,
the parent a small process that forwards the launcher's signals to it, waits for it, and names it when it
dies without a message. Standard library only: importing mpi4py here would start MPI in the supervisor.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import termios
import time

from hpengine.run import startguard

FAILURES = "failures.jsonl"
# hpengine's own exit statuses (faults.EXIT_*, cli.commands): 0 done, 1 a traceback (already printed),
# 2 bad input, 70 launcher gone, 75 stopped by SIGTERM/SIGUSR1, 130 Ctrl-C, 141 stdout closed
OWN_STATUSES = (0, 1, 2, 70, 75, 130, 141)
EXIT_ORPHANED = 70
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGTSTP")
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
PR_SET_PDEATHSIG = 1
READ_WAIT_S = 2.0          # longest wait for the launcher to read the line naming a dead rank
_state = {"supervisor": None, "fd": None}       # in the rank: its supervisor's pid and the pipe to it

_HINTS = {
    "SIGKILL": "killed by a user, the scheduler or the out-of-memory killer (`dmesg` or `journalctl -k` says "
               "which)",
    "SIGSEGV": "a crash in native code (NumPy, MPI, a device library or the interpreter)",
    "SIGBUS": "a crash in native code, or a memory-mapped file that shrank or a full /dev/shm",
    "SIGILL": "a crash in native code (a library built for another CPU?)",
    "SIGFPE": "a crash in native code",
    "SIGABRT": "abort() in native code: a failed assertion or fatal error in a library (MPI, BLAS, a device "
               "library)",
    "SIGXCPU": "the CPU time limit was reached (`ulimit -t`, or the scheduler's)",
}
_SENT = ("sent to the rank's own pid (by a user, the scheduler or a tool) while it did not handle it (starting "
         "or ending)")


def wanted(argv=None, orig_argv=None, env=None) -> bool:
    """Whether this process is `hpengine train` started by an MPI launcher, not yet supervised, on Linux,
    and HPENGINE_SUPERVISOR is not 0."""
    env = os.environ if env is None else env
    if env.get("HPENGINE_SUPERVISOR", "").strip() == "0" or _state["supervisor"] is not None:
        return False
    if not sys.platform.startswith("linux") or not startguard.under_launcher(env):
        return False
    return _subcommand(sys.argv if argv is None else argv,
                       getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv) == "train"


def _subcommand(argv, orig_argv):
    """The hpengine subcommand of the console script or `python -m hpengine` (argv[0] is '-m' while the
    package imports); None for anything else (pytest, a user's script)."""
    if len(argv) < 2:
        return None
    if os.path.basename(argv[0]) == "hpengine":
        return argv[1]
    if argv[0] == "-m":
        for i, a in enumerate(orig_argv[1:], 1):
            if a == "-m":
                return argv[1] if orig_argv[i + 1:i + 2] == ["hpengine"] else None
            if a.startswith("-m"):
                return argv[1] if a == "-mhpengine" else None
    return None


def _shares_group(parent_comm=None) -> bool:
    """Under srun the step's processes are signalled together (cgroup or process group): the rank then
    stays in the supervisor's process group and gets each signal directly, so nothing is forwarded."""
    return (_parent_comm() if parent_comm is None else parent_comm) == "slurmstepd"


def _parent_comm() -> str:
    try:
        with open(f"/proc/{os.getppid()}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def supervise() -> None:
    """Fork: returns in the child, which is the rank; the parent supervises it and never returns."""
    shared = _shares_group()
    sigs = [getattr(signal, n) for n in FORWARDED]
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)    # none is lost, nor acted on, in between
    launcher, me = os.getppid(), os.getpid()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        _become_rank(me, w, shared)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        return
    os.close(w)
    if not shared:
        try:
            os.setpgid(child, child)     # also in the child: whichever runs first
        except OSError:
            pass
    sup = Supervisor(child, r, launcher, forward=not shared)
    for s in sigs:
        signal.signal(s, sup.on_signal)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    os._exit(sup.run())


def _become_rank(supervisor: int, fd: int, shared: bool) -> None:
    """The child's side: its own process group (a launcher signals the supervisor's group, and the
    supervisor forwards once), death with its supervisor, the start-up guard."""
    if not shared:
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != supervisor:     # it died before prctl took effect
        os._exit(EXIT_ORPHANED)
    _state.update(supervisor=supervisor, fd=fd)
    startguard.arm()


def parent_pid():
    """The pid of this rank's supervisor; None when the rank is not supervised."""
    return _state["supervisor"]


def report(record: dict, run_dir, survive: bool = False) -> None:
    """Tell the supervisor who this rank is (faults.rank_record), where its run folder is, and whether the job
    survives the rank's death (resilience.on_failure = "spare")."""
    _tell({"record": record, "run_dir": os.path.abspath(str(run_dir)), "survive": survive})


def leaving(status: int) -> None:
    """Tell the supervisor that this rank ends now with exit status `status`, the job's other survivors with it
    (resilience: the line saying why is out): a launcher that ends the job as the first of them exits is then
    no fault of this rank's, and its supervisor exits with `status` too."""
    _tell({"leaving": status})


def _tell(msg: dict) -> None:
    if _state["fd"] is None:
        return
    try:
        os.write(_state["fd"], (json.dumps(msg) + "\n").encode())
    except OSError:          # the supervisor is gone: PR_SET_PDEATHSIG ends this process
        pass


def describe(r: dict) -> str:
    """A rank as every hpengine line names it (faults.describe)."""
    return f"rank {r['rank']} {r['prefix']} (pid {r['pid']} on {r['host']})"


def _env_record(pid: int, env) -> dict:
    """A rank that died before it reported: the launcher's rank variable, its pid and this host."""
    rank = next((env[k] for k in RANK_VARS if k in env), None)
    return {"rank": int(rank) if rank and rank.isdigit() else None, "pid": pid, "host": socket.gethostname(),
            "coords": None, "prefix": None, "supervisor_pid": os.getpid()}


def _who(rec) -> str:
    if rec.get("prefix") is not None:
        return describe(rec)
    return (f"rank {'?' if rec['rank'] is None else rec['rank']} (pid {rec['pid']} on {rec['host']}, while "
            "starting: before its mesh coordinates were known)")


def verdict(code: int, rec, pid: int, env=None, core: bool = False, sent=()):
    """(line, failures.jsonl entry, supervisor's exit status) for a rank that ended with `code`
    (os.waitstatus_to_exitcode: negative for a signal); line and entry are None when hpengine ended the
    rank itself (it has said why), or when the signal that ended it is one the job was sent (`sent`: the
    supervisor got it too, from the launcher or a user, who know)."""
    status = 128 - code if code < 0 else code
    if (code >= 0 and code in OWN_STATUSES) or -code in sent:
        return None, None, status
    rec = rec or _env_record(pid, os.environ if env is None else env)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        number = "" if name.startswith("signal ") else f" (signal {-code})"
        what = (f"was killed by {name}{number}{' (core dumped)' if core else ''}: "
                f"{_HINTS.get(name, _SENT)}")
    else:
        name = None
        what = (f"exited with status {code}, which hpengine never uses ({', '.join(map(str, OWN_STATUSES))}): "
                "something outside hpengine ended the process (a library's exit() or a fatal error in native "
                "code)")
    line = f"hpengine: {_who(rec)} {what}; the job ends"
    entry = failure("signal" if code < 0 else "exit", rec, line, signal=name, signum=-code if code < 0 else None,
                    exit_status=status, core_dumped=core)
    return line, entry, status


def failure(event: str, rec: dict, line: str, **fields) -> dict:
    """A failures.jsonl entry: what happened (`event`), to which rank (its record), and the line said."""
    return {"event": event, "rank": rec["rank"], "coords": rec.get("coords"), "prefix": rec.get("prefix"),
            "host": rec["host"], "pid": rec["pid"], "supervisor_pid": rec.get("supervisor_pid"), **fields,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "message": line}


def append_failure(run_dir, entry: dict) -> None:
    """One JSON line appended to RUN_DIR/failures.jsonl in one write (several ranks may append at once)."""
    if not run_dir:
        return
    try:
        fd = os.open(os.path.join(str(run_dir), FAILURES), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                     0o644)     # never through a planted link
        try:
            os.write(fd, (json.dumps(entry) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def recorded(run_dir, pid: int) -> bool:
    """Whether RUN_DIR/failures.jsonl already names the rank of this pid."""
    try:
        with open(os.path.join(str(run_dir), FAILURES)) as f:
            return any(json.loads(x).get("pid") == pid for x in f if x.strip())
    except (OSError, ValueError, TypeError):
        return False


def _emit(line: str) -> None:
    """faults.say's one write to stderr (faults imports mpi4py, which the supervisor must not)."""
    try:
        os.write(2, (line.rstrip("\n") + "\n").encode())
    except OSError:           # the launcher's end of the pipe is gone
        pass


def until_read(fd: int = 2, wait_s: float = READ_WAIT_S, poll_s: float = 0.01) -> None:
    """Return once the reader of `fd` (a pipe or socket: the launcher's) has taken everything written to it,
    or after wait_s: a launcher that tears the job down as soon as it sees the supervisor exit may never read
    what the supervisor wrote just before. Files and terminals need no wait."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return
    request = termios.FIONREAD if stat.S_ISFIFO(mode) else termios.TIOCOUTQ if stat.S_ISSOCK(mode) else None
    end = time.monotonic() + wait_s
    while request is not None and time.monotonic() < end:
        try:
            unread = struct.unpack("i", fcntl.ioctl(fd, request, b"\0" * 4))[0]
        except OSError:
            return
        if unread <= 0:
            return
        time.sleep(poll_s)


# The parent forwards the launcher's signals to the rank, waits for it, and, when it dies
# without a message (a signal, or an exit status hpengine never uses), names it on stderr and in the run
# folder's failures.jsonl before exiting with its status, so the launcher cannot learn of the death first; it
# exits once the launcher has read that line (a launcher may drop what an exited process left unread).
class Supervisor:
    """The parent's loop: read the rank's record, forward signals, notice the child's end and the
    launcher's (the supervisor's parent changes), then say what happened and exit with the status."""

    def __init__(self, child: int, fd: int, launcher: int, poll_s: float = 0.5, forward: bool = True):
        self.child, self.fd, self.launcher, self.poll_s, self.forwards = child, fd, launcher, poll_s, forward
        self.record, self.run_dir, self._buf, self.sent = None, None, b"", set()
        self.survive = False        # the rank said the job survives its death (resilience.on_failure)
        self.leaving = None         # the exit status the rank said it ends with, with the job's other survivors

    def on_signal(self, signum, frame=None) -> None:
        """A signal for the rank: noted (a death by it is the sender's doing, not a fault), and forwarded
        unless the rank gets it directly (see _shares_group)."""
        self.sent.add(signum)
        if self.forwards:
            self.forward(signum)

    def forward(self, signum) -> None:
        try:
            os.kill(self.child, signum)
        except ProcessLookupError:
            pass

    def run(self) -> int:
        child_fd, parent_fd = _pidfd(self.child), _pidfd(self.launcher)
        watched = [fd for fd in (self.fd, child_fd, parent_fd) if fd is not None]
        while True:
            ready = select.select(watched, [], [], self.poll_s if child_fd is not None else 0.05)[0]
            if self.fd in ready and not self._read():
                watched.remove(self.fd)          # the rank closed it (or exited): pidfd or polling tell
            done, wstatus = os.waitpid(self.child, os.WNOHANG)
            if done:
                return self._ended(wstatus)
            if os.getppid() != self.launcher:
                return self._orphaned()

    def _read(self) -> bool:
        """Take what the rank sent; False at end of file."""
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            try:
                msg = json.loads(line)
                if "leaving" in msg:
                    self.leaving = int(msg["leaving"])
                    continue
                self.record, self.run_dir = msg["record"], msg["run_dir"]
                self.survive = bool(msg.get("survive"))
            except (ValueError, KeyError, TypeError):
                pass
        return bool(data)

    def _drain(self) -> None:
        """What the rank wrote just before it died (the child is gone: nothing more comes)."""
        os.set_blocking(self.fd, False)
        while self._read() and select.select([self.fd], [], [], 0)[0]:
            pass

    def _ended(self, wstatus: int) -> int:
        self._drain()
        if self.leaving is not None and os.WIFSIGNALED(wstatus) and (
                os.WTERMSIG(wstatus) in (*self.sent, signal.SIGKILL)):
            return self.leaving       # it was ending anyway: the launcher's end of the job caught up with it
        line, entry, status = verdict(os.waitstatus_to_exitcode(wstatus), self.record, self.child,
                                      core=os.WIFSIGNALED(wstatus) and os.WCOREDUMP(wstatus), sent=self.sent)
        if line and self.survive:
            line = line.replace("; the job ends", "; the job goes on without it (resilience.on_failure)")
            entry["message"] = line
        if line:                 # the file first: a rank's peer that sees the death reads it to stay quiet
            append_failure(self.run_dir, entry)
            _emit(line)
            until_read(2)        # the launcher reads the line before it learns of the exit
        if self.survive and os.WIFSIGNALED(wstatus):
            # Open MPI's ULFM reports a process that dies of a signal as failed (the others go on); one that
            # exits with a status makes mpirun end the job
            sig = os.WTERMSIG(wstatus)
            if sig != signal.SIGKILL:      # SIGKILL has no handler to reset, nor a mask
                signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
            os.kill(os.getpid(), sig)
        return status

    def _orphaned(self) -> int:
        self._drain()
        if self.leaving is not None:      # a peer's exit ended the job while this rank was ending it too
            self.forward(signal.SIGKILL)
            os.waitpid(self.child, 0)
            return self.leaving
        rec = self.record or _env_record(self.child, os.environ)
        line = (f"hpengine: {_who(rec)}: the launcher is gone (parent process {self.launcher} exited, now "
                f"{os.getppid()}); ending the rank, as no collective can finish")
        append_failure(self.run_dir, failure("orphaned", rec, line, exit_status=EXIT_ORPHANED))
        _emit(line)
        self.forward(signal.SIGKILL)
        os.waitpid(self.child, 0)
        return EXIT_ORPHANED


def _pidfd(pid: int):
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):     # no pidfd (old kernel): polled
        return None
