"""Knowing which rank runs where, and noticing when a peer rank or the launcher is gone:
`write_ranks_file` (ranks.jsonl), the per-rank `Monitor` thread, the exit codes, and `say`, one stderr line
written with one write call (lines of several ranks never glue together).
"""
from __future__ import annotations

import json
import os
import select
import socket
import threading
import time

from mpi4py import MPI

from hpengine.files import write_file
from hpengine.run import supervisor
from hpengine.run.launch import launcher_size

EXIT_ORPHANED = 70          # the launcher died: nothing to report to, no collective can finish
EXIT_INTERRUPTED = 130      # SIGINT, as a shell reports a Ctrl-C
EXIT_STOPPED = 75           # SIGTERM/SIGUSR1: a clean early stop with a checkpoint (EX_TEMPFAIL: resubmit)


def say(line: str, stream=None) -> None:
    """Write `line` and its newline to stderr (or stream) in one write call, then flush."""
    text = line.rstrip("\n") + "\n"
    try:
        if stream is None:           # straight to the descriptor: no lock or buffer to wait for
            os.write(2, text.encode())
        else:
            stream.write(text)
            stream.flush()
    except (OSError, ValueError):      # the reader of a dead launcher's pipe is gone
        pass


def rank_record(mesh) -> dict:
    """This rank's line of ranks.jsonl; its per-node facts (local_rank, node_ranks, blas_threads, device,
    memory_limit) are the values run/build.py decided with, kept on the mesh."""
    return {"rank": mesh.rank, "host": socket.gethostname(), "pid": os.getpid(), "ppid": os.getppid(),
            "coords": dict(mesh.coords), "prefix": mesh.prefix(), "supervisor_pid": supervisor.parent_pid(),
            **mesh.node}


def gather_ranks(world, mesh) -> list[dict]:
    """Every rank's record (collective on world), in rank order."""
    mine = rank_record(mesh)
    return world.allgather(mine) if world.Get_size() > 1 else [mine]


# `write_ranks_file`: ranks.jsonl in the run folder, one line per rank: rank, host, pid, parent pid, the
# supervisor's pid, mesh coordinates and the rank's place on its node, so a PID in a launcher's message can
# be mapped to a rank.
def write_ranks_file(records: list[dict], out, rank: int):
    """ranks.jsonl in the run folder (rank 0 writes it); returns its path."""
    path = os.path.join(str(out), "ranks.jsonl")
    if rank == 0:
        write_file(path, "".join(json.dumps(r) + "\n" for r in records), durable=False)
    return path


def describe(r: dict) -> str:
    return f"rank {r['rank']} {r['prefix']} (pid {r['pid']} on {r['host']})"


def launched() -> bool:
    """True when an MPI launcher started this process (its parent is the launcher or its proxy)."""
    found = launcher_size()
    return found is not None and found[2] == "launched"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def failures_size(run_dir) -> int:
    """Bytes of the run folder's failures.jsonl (0 when there is none or no folder)."""
    try:
        return os.stat(os.path.join(str(run_dir), supervisor.FAILURES)).st_size if run_dir else 0
    except OSError:
        return 0


def _abort(code: int) -> None:
    MPI.COMM_WORLD.Abort(code)


def _named_by_supervisor(r: dict, run_dir) -> bool:
    """Whether the dead rank's supervisor names it: it is still alive (about to), or has already."""
    sup = r.get("supervisor_pid")
    return bool(sup) and (_alive(sup) or (run_dir is not None and supervisor.recorded(run_dir, r["pid"])))


# `Monitor`: a daemon thread per rank while the training loop runs. It watches
#   * the peer ranks on the same host (pidfd, or polling where there is none): when one exits while this
#     rank is still training, the lowest surviving rank on that host names it (unless the peer's supervisor,
#     run/supervisor.py, does), and after `peer_grace_s` (a launcher such as Hydra normally ends the job
#     first) the job is aborted;
#   * its own parent process (the launcher's proxy, or the rank's supervisor): when it changes, the launcher
#     is gone and the rank exits at once with EXIT_ORPHANED, saying why, instead of training on as an orphan;
#   * the run folder's failures.jsonl: when it grows (a rank's supervisor, on any node, recorded a death),
#     the job is aborted after `peer_grace_s` unless the launcher ended it first;
#   * an interrupt (SIGINT): when the agreed stop at the next step boundary has not come within
#     `interrupt_grace_s`, the job is aborted with exit status 130.
# The Monitor's lines also go to the run folder's failures.jsonl.
class Monitor:
    """See the comment above. `records` come from gather_ranks; `run_dir` (optional) is the run folder whose
    failures.jsonl gets the lines too; `abort` and `exit` are replaceable for tests."""

    def __init__(self, records: list[dict], rank: int, watch_parent: bool, poll_s: float = 0.5,
                 peer_grace_s: float = 3.0, interrupt_grace_s: float = 5.0, abort=None, exit=None, stream=None,
                 run_dir=None, failures_seen=None, survive: bool = False):
        self.me = records[rank] if records else None
        host = socket.gethostname()
        self.peers = [r for r in records if r["rank"] != rank and r["host"] == host]
        self.rank, self.poll_s = rank, poll_s
        self.peer_grace_s, self.interrupt_grace_s = peer_grace_s, interrupt_grace_s
        self.abort, self.exit, self.stream = abort or _abort, exit or os._exit, stream
        self.ppid = os.getppid() if watch_parent else None
        self.run_dir = run_dir
        # the size of failures.jsonl before this run's ranks could write to it (a resumed run's folder may
        # hold an earlier run's lines)
        self.failures_seen = failures_size(run_dir) if failures_seen is None else failures_seen
        self.interrupted_at = None
        self.survive = survive        # resilience.on_failure = "spare": a peer's death is survived, not aborted on
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> "Monitor":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hpengine-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def interrupted(self) -> None:
        """Called from the SIGINT handler: start the clock of the grace before the abort."""
        if self.interrupted_at is None:
            self.interrupted_at = time.monotonic()

    def _pidfds(self) -> dict:
        fds = {}
        for r in self.peers:
            try:
                fds[os.pidfd_open(r["pid"])] = r
            except (AttributeError, OSError):     # no pidfd (old kernel) or already gone: polled instead
                pass
        return fds

    def _run(self) -> None:
        fds = self._pidfds()
        polled = [r for r in self.peers if r not in fds.values()]
        try:
            while not self._stop.is_set():
                if fds:
                    ready = select.select(list(fds), [], [], self.poll_s)[0]
                else:
                    ready = []
                    self._stop.wait(self.poll_s)
                if self._stop.is_set():
                    return
                gone = [fds[fd] for fd in ready] + [r for r in polled if not _alive(r["pid"])]
                if gone and self.survive:        # the recovery names it; the other peers are still watched
                    for fd in [fd for fd, r in fds.items() if r in gone]:
                        os.close(fd)
                    fds = {fd: r for fd, r in fds.items() if r not in gone}
                    polled = [r for r in polled if r not in gone]
                elif gone:
                    self._peer_gone(gone)
                    return
                if self.ppid is not None and os.getppid() != self.ppid:
                    self._orphaned()
                    return
                if failures_size(self.run_dir) > self.failures_seen and self.survive:
                    self.failures_seen = failures_size(self.run_dir)
                elif failures_size(self.run_dir) > self.failures_seen:
                    self._failure_recorded()
                    return
                if self.interrupted_at is not None and time.monotonic() - self.interrupted_at > self.interrupt_grace_s:
                    say(f"hpengine: rank {self.rank}: interrupted, and the ranks did not agree on a stop within "
                        f"{self.interrupt_grace_s:g} s; aborting the job", self.stream)
                    self.abort(EXIT_INTERRUPTED)
                    return
        finally:
            for fd in fds:
                os.close(fd)

    def _peer_gone(self, gone: list[dict]) -> None:
        living = [r["rank"] for r in self.peers if r not in gone and _alive(r["pid"])] + [self.rank]
        unnamed = [r for r in gone if not _named_by_supervisor(r, self.run_dir)]
        if unnamed and self.rank == min(living):      # one line per host, from the lowest surviving rank
            line = (f"hpengine: {', '.join(describe(r) for r in unnamed)} ended while {describe(self.me)} was "
                    "still training: that rank died (killed, out of memory, or crashed without a message); the "
                    "job ends")
            for r in unnamed:
                supervisor.append_failure(self.run_dir, supervisor.failure("peer_died", r, line,
                                                                           noticed_by=self.rank))
            say(line, self.stream)
        if not self._stop.wait(self.peer_grace_s):
            self.abort(1)

    def _failure_recorded(self) -> None:
        """A rank's failure was recorded in the run folder (by its supervisor, perhaps on another node) and
        this rank still runs: the launcher normally ends the job first; after `peer_grace_s` the job is
        aborted, so a launcher that misses a node's death (or a rank waiting on it in a collective) cannot
        leave it hanging."""
        if not self._stop.wait(self.peer_grace_s):
            self.abort(1)

    def _orphaned(self) -> None:
        line = (f"hpengine: {describe(self.me)}: the launcher is gone (parent process {self.ppid} exited, now "
                f"{os.getppid()}); exiting, as no collective can finish")
        supervisor.append_failure(self.run_dir, supervisor.failure("orphaned", self.me, line,
                                                                   exit_status=EXIT_ORPHANED))
        say(line, self.stream)
        self.exit(EXIT_ORPHANED)
