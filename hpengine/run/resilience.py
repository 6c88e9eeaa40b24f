"""A job that outlives a rank (resilience.on_failure = "spare", over ULFM): the start-up that holds the spares
idle, the buddy copies after every step, and the recovery: every communicator revoked, the world shrunk, a spare
in the dead rank's mesh place, the engine built again, its state from the buddy copies, the step run again.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time

import numpy as np
from mpi4py import MPI

from hpengine.dist import ulfm
from hpengine.dist.agree import agree_or_raise
from hpengine.dist.buddy import Buddies, shift_of, unpack
from hpengine.engine import held
from hpengine.run import faults, progress, shrink, supervisor, trace
from hpengine.run.build import build_job, compute_dtype
from hpengine.run.launch import LaunchError
from hpengine.run.run_dir import trim_metrics

log = logging.getLogger("hpengine")
# tests: "WORLD_RANK@STEP,...": that process SIGKILLs itself as step STEP begins; "WORLD_RANK@save:STEP": once it
# has written its shard of the checkpoint of step STEP (the one checkpoint.at_end asks for too);
# "WORLD_RANK@eval:STEP": as the evaluation after step STEP begins; "WORLD_RANK@wait": a spare, as it starts
# waiting; "WORLD_RANK@end": as the end-of-run barrier begins
KILL_VAR = "HPENGINE_FAULT_KILL"
KILL_POINTS = ("save", "eval")          # the kill points that name a step; "wait" and "end" name none


class LeftMesh(Exception):
    """Shrink mode: this rank's replica left the mesh with a dead rank; it serves as a spare from now on."""


def kill_plan(env=None) -> dict:
    """{world rank: (step, where)} from HPENGINE_FAULT_KILL ("1@3,4@save:5,2@eval:3,5@wait,3@end"; where: "step",
    "save", "eval", or "wait" and "end" with step 0); the fault injection of the resilience tests."""
    text = (os.environ if env is None else env).get(KILL_VAR, "").strip()
    plan = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        rank, _, step = item.partition("@")
        where, _, n = step.rpartition(":")
        if step in ("wait", "end"):
            where, n = "", "0"
        if not (rank.isdigit() and n.isdigit() and where in ("", *KILL_POINTS)):
            raise LaunchError(f"{KILL_VAR} = {text!r}: give WORLD_RANK@STEP, WORLD_RANK@save:STEP, "
                              "WORLD_RANK@eval:STEP, WORLD_RANK@wait or WORLD_RANK@end items separated by commas, "
                              "e.g. 1@3,2@save:4")
        plan[int(rank)] = (int(n), step if step in ("wait", "end") else where or "step")
    return plan


class Resilience:
    """One rank's part in surviving failures. `world` holds every rank, spares included (the last
    resilience.spares ranks); `compute` the mesh's ranks (COMM_NULL on a spare); `place` this rank's mesh
    place (its compute rank; -1 on a spare)."""

    def __init__(self, cfg, world=None):
        self.cfg, self.world = cfg, world or MPI.COMM_WORLD
        ulfm.errors_return(self.world)

        def check():
            why = ulfm.missing()
            if why:
                raise LaunchError(f"resilience.on_failure = {cfg.resilience.on_failure!r} needs {ulfm.NEEDS}; "
                                  f"here {why}")
        agree_or_raise(self.world, check, LaunchError, (LaunchError,))
        n, spares = self.world.Get_size(), cfg.resilience.spares
        if spares >= n:
            raise LaunchError(f"resilience.spares = {spares} leaves no rank to train on {n} rank(s): launch "
                              f"(mesh ranks + {spares}) ranks")
        self.origin = self.world.Get_rank()           # this process's rank at launch (the fault plan's key)
        self.kill_at = kill_plan().get(self.origin, (None, None))
        self.places = n - spares                      # the mesh's ranks: place p is world rank p at launch
        hosts = self.world.allgather(socket.gethostname())
        self.hosts = hosts[:self.places]              # the node of each place
        self.waiting = {r: (r, hosts[r]) for r in range(self.places, n)}   # a spare's world rank: (launch rank, host)
        self.compute = ulfm.split_spares(self.world, spares)
        self.place = -1 if self.compute == MPI.COMM_NULL else self.compute.Get_rank()
        self.buddies = self._buddies()
        self.recovery = None        # the last recovery's record, until the step after it completes
        self.mesh = None            # the mesh of the engine last committed (places' coordinates)
        self.predicted = 0          # the buddy copies' bytes the start-up prediction counted
        self.saving = self.resave = -1      # the step of the checkpoint being written; of one a failure cut short

    @property
    def spare(self) -> bool:
        return self.place < 0

    def _buddies(self):
        if self.spare:
            return None
        return Buddies(self.compute, shift_of(self.compute.allgather(socket.gethostname())))

    # --- in the training loop ----------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        """The test hook: this process dies as step `step` + 1 begins when HPENGINE_FAULT_KILL says so."""
        if self.kill_at == (step + 1, "step"):
            self._die(f"as step {step + 1} begins")

    def before(self, where: str, step: int = 0) -> None:
        """The test hook at the evaluation after step `step` ("eval") or the end-of-run barrier ("end")."""
        if self.kill_at == (step, where):
            self._die({"eval": f"as the evaluation after step {step} begins",
                       "end": "as the end-of-run barrier begins"}[where])

    def save_hook(self, step: int):
        """The test hook inside a save: called once this rank's shard of step `step` is written (None: no kill)."""
        return (lambda: self._die(f"after writing its shard of the checkpoint of step {step}")) if (
            self.kill_at == (step, "save")) else None

    def _die(self, when: str) -> None:
        log.warning("fault injection (%s): launch rank %d SIGKILLs itself %s, at unix time %.3f", KILL_VAR,
                    self.origin, when, time.time())
        for h in log.handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def finish(self) -> None:
        """The run is over: a barrier of the mesh's ranks (nobody exits while a peer still watches it), then one
        of every rank of the job, which lets the spares still waiting go home. A rank dead by then (a spare that
        died while it waited too) fails it: the recovery, then this again. The mesh's barrier comes first so
        that no rank revokes a communicator while a peer is still inside a collective on it."""
        self.before("end")
        if self.compute.Get_size() > 1:
            self.compute.Barrier()
        ulfm.release_spares(self.world)

    def commit(self, eng, steps: int) -> None:
        """This rank's state after `steps` optimizer steps, kept here and on its buddy (collective)."""
        self.mesh = eng.mesh
        arrays, facts = eng.held_state()
        self.buddies.commit(steps, arrays, facts)

    def ready(self) -> None:
        """The recovery is over (the engine rebuilt and filled, its copies made): its seconds are recorded."""
        self.recovery["recovery_s"] = round(time.perf_counter() - self.t_failed, 4)
        self.recovery["recovered_at_unix"] = round(time.time(), 3)

    def note(self, m: dict) -> None:
        """Adds the last recovery's fields to the first step's metrics after it (metrics.jsonl records it)."""
        if self.recovery:
            m.update(self.recovery)
            self.recovery = None

    def handles(self, exc: BaseException) -> bool:
        """Whether exc is (may be) a peer's death, which this job survives."""
        return ulfm.is_failure(exc, self.world, comms=(self.compute, self.world))

    def survivor(self) -> int:
        """The compute rank of the lowest mesh place that survived the last recovery (its history is the run's)."""
        if self.recovery and "root" in self.recovery:       # a shrink: every new mesh rank was training
            return self.recovery["root"]
        dead = set(self.recovery["dead_ranks"]) if self.recovery else set()
        return min(p for p in range(self.places) if p not in dead)

    def copy_bytes(self) -> int:
        return self.buddies.nbytes() if self.buddies else 0

    # --- a failure ---------------------------------------------------------------------------------------
    def wait(self) -> bool:
        """A spare's wait; True when a rank died (then recover()), False when the run ended without it. Its
        supervisor is told first that the job survives this rank's death."""
        record = {"rank": self.origin, "host": socket.gethostname(), "pid": os.getpid(), "ppid": os.getppid(),
                  "coords": None, "prefix": "[spare]", "supervisor_pid": supervisor.parent_pid()}
        supervisor.report(record, self.cfg.train.out_dir, survive=True)
        if self.kill_at[1] == "wait":
            self._die("as it starts waiting as a spare")
        return ulfm.wait_as_spare(self.world)

    def recover(self, comms=()):
        """Every live rank (spares too) after a failure: revokes `comms` and the world, shrinks it, puts a spare
        in each dead rank's place (shrink mode with too few spares: drops the dead rank's replica, shrink.py) and
        hands each rank its state at the newest step every survivor holds. Returns (step, arrays, facts, owners)
        to build and fill this rank's engine from (owners: every old owner's copy when sharding fell, else None),
        or None on a rank left a spare (it waits again). self.recovery then describes it (dead places, their
        hosts, the spares or the shrink); self.resave is the step of a save the failure interrupted (-1: none)."""
        self.t_failed = time.perf_counter()
        ulfm.revoke_all([*comms, self.compute, self.world])
        held = (self.buddies.latest(), self.buddies.shift) if self.buddies else (-1, 0)
        small, members = ulfm.shrink(self.world, (self.place, *held, socket.gethostname(), self.origin,
                                                  self.saving))
        self.world, self.saving = small, -1
        olds = {o for o, _ in members}
        dead_spares = sorted(v for r, v in self.waiting.items() if r not in olds)     # (launch rank, host)
        alive = [m for m in members if m[1][0] >= 0]
        step = min(s for _, (_, s, *_) in alive)
        shift = alive[0][1][2]
        self.resave = max(m[1][5] for m in members)
        dead = sorted(set(range(self.places)) - {p for _, (p, *_) in alive})
        if not dead and not dead_spares:          # the same membership everywhere: every rank ends together
            _end_job(small, "hpengine: an MPI error stopped a step but every rank is alive, so no rank died; "
                     f"the job ends; {shrink.last_checkpoint(self.cfg)}")
        idle = sum(1 for _, (p, *_) in members if p < 0)
        if self.cfg.resilience.on_failure == "shrink" and idle < len(dead):
            got = self._shrink(small, members, dead, step, shift)
            self.recovery["dead_spares"] = [r for r, _ in dead_spares]
            self.recovery["dead_spare_hosts"] = [h for _, h in dead_spares]
            return got
        lost = [p for p in dead if (p + shift) % self.places in dead]
        if idle < len(dead) or lost:        # the same facts on every rank: every rank ends together
            spares = f" (and the waiting spares launch ranks {[r for r, _ in dead_spares]})" if dead_spares else ""
            _end_job(small, f"hpengine: mesh places {dead}{spares} died and " + (
                f"only {idle} spare(s) are left: start the job with more resilience.spares" if idle < len(dead)
                else f"places {lost} died together with the places holding their buddy copies") +
                f"; the job ends; {shrink.last_checkpoint(self.cfg)}")
        compute, place, filled = ulfm.placed(small, [(o, p) for o, (p, *_) in members], self.places)
        dead_hosts = [self.hosts[p] for p in dead]
        mine = self._hand_over(compute, place, dead, step, shift) if compute != MPI.COMM_NULL else None
        self.compute, self.place = compute, place
        for _, (p, _, _, host, *_) in members:
            if p >= 0:
                self.hosts[p] = host
        spare_host = {o: h for o, (_, _, _, h, *_) in members}
        launch_rank = {o: m[4] for o, m in members}
        for p, o in filled:
            self.hosts[p] = spare_host[o]
        self.buddies = self._buddies()
        taken = {o for _, o in filled}
        self.waiting = {i: (m[4], m[3]) for i, (o, m) in enumerate(members) if m[0] < 0 and o not in taken}
        self.recovery = {"recovered_step": step + 1, "dead_ranks": dead, "dead_hosts": dead_hosts,
                         "spare_ranks": [launch_rank[o] for _, o in sorted(filled)],
                         "dead_spares": [r for r, _ in dead_spares], "dead_spare_hosts": [h for _, h in dead_spares]}
        return None if mine is None else (step, *mine, None)

    def _shrink(self, small, members, dead: list, step: int, shift: int):
        """No spare for the dead: its replica leaves the mesh (its survivors wait as spares) and dp, or sharding,
        falls by one; or, where no smaller layout fits, every survivor ends the job in one line."""
        lead = min(i for i, (_, (p, *_)) in enumerate(members) if p >= 0)    # a rank that knows the mesh
        got = coords = None
        if small.Get_rank() == lead:
            coords = [self.mesh.coords_of(p) for p in range(self.places)]
            got = shrink.plan(self.cfg, dict(self.mesh.degrees), self.mesh.axes, coords, dead)
            lost = [p for p in dead if (p + shift) % self.places in dead]
            if isinstance(got, shrink.Plan) and got.axis == "sharding" and lost:
                got = f"mesh places {lost} died together with the places holding their buddy copies"
        got, coords = small.bcast((got, coords), root=lead)
        if not isinstance(got, shrink.Plan):
            where = [f"rank {p} ({_coords(coords[p])}) on {self.hosts[p]}" for p in dead]
            line = (f"hpengine: {', '.join(where)} died and no spare is left; shrink mode cannot go on: {got}; "
                    f"the job ends; {shrink.last_checkpoint(self.cfg)}")
            _end_job(small, line)
        owners = (shrink.owners_of(small, members, coords, dead, self.place, step, shift, self.buddies)
                  if got.axis == "sharding" else None)
        new = got.new[self.place] if self.place >= 0 else -1
        compute = ulfm.mesh_of(small, new)
        mine = self.buddies.own(step) if new >= 0 else None
        hosts = {got.new[p]: host for _, (p, _, _, host, *_) in members if p >= 0 and got.new[p] >= 0}
        launch_rank = {p: m[4] for _, m in members if (p := m[0]) >= 0}
        self.recovery = {"recovered_step": step + 1, "dead_ranks": dead, "dead_hosts": [self.hosts[p] for p in dead],
                         "dead_coords": [coords[p] for p in dead], "shrunk": f"{got.axis} {got.n} -> {got.n - 1}",
                         "left_ranks": sorted(launch_rank[p] for p in launch_rank if got.new[p] < 0), "root": 0}
        self.compute, self.place, self.places, self.cfg = compute, new, len(hosts), got.cfg
        self.hosts = [hosts[p] for p in range(len(hosts))]
        self.waiting = {i: (m[4], m[3]) for i, (_, m) in enumerate(members) if m[0] < 0 or got.new[m[0]] < 0}
        self.buddies = self._buddies()
        return None if mine is None else (step, *mine, owners)

    def _hand_over(self, compute, place: int, dead: list, step: int, shift: int):
        """(arrays, facts) of this rank at `step`: its own copy, or (a spare now in a dead place) the copy its
        buddy kept, sent over the new compute communicator."""
        holders = {p: (p + shift) % self.places for p in dead}
        out = None
        for p, holder in holders.items():
            if place == holder:
                meta, data, facts = self.buddies.partner(step)
                compute.send((meta, data.size, facts), dest=p, tag=43)
                compute.Send([data, MPI.BYTE], dest=p, tag=44)
            elif place == p:
                meta, size, facts = compute.recv(source=holder, tag=43)
                buf = np.empty(size, np.uint8)
                compute.Recv([buf, MPI.BYTE], source=holder, tag=44)
                out = (unpack(meta, buf), facts)
        return out if out is not None else self.buddies.own(step)


# --- the training loop's side of a recovery ---------------------------------------------------------------
def rebuilt(cfg, guard, got):
    """The engine on the recovered mesh, in the state of step got[0] (got: Resilience.recover's answer),
    its buddy copies made again; the line naming the dead ranks."""
    step, arrays, facts, owners = got
    eng = build_job(cfg, guard.compute)[0]
    if owners is None:
        eng.restore_held(arrays, facts)
    else:
        held.restore_repartitioned(eng, arrays, facts, owners)
    guard.commit(eng, step)
    guard.ready()
    rec = guard.recovery
    # a spare's mesh has the old one's shape: the dead places' coordinates are read off it
    rec.setdefault("dead_coords", [eng.mesh.coords_of(p) for p in rec["dead_ranks"]])
    for i, (p, host, c) in enumerate(zip(rec["dead_ranks"], rec["dead_hosts"], rec["dead_coords"])):
        went = (f"a spare (launch rank {rec['spare_ranks'][i]}) took its place" if "shrunk" not in rec else
                f"no spare: its replica left the mesh ({rec['shrunk']}; launch ranks {rec['left_ranks']} wait as "
                "spares)")
        goes = (f"training goes on from step {step + 1}" if step < cfg.train.steps else
                f"all {step} steps were done: the run's end is run again")
        if eng.mesh.rank == 0:
            faults.say(f"hpengine: rank {p} ({_coords(c)}) on {host} died; {went}; {goes} "
                       f"({rec['recovery_s']:.2f} s to recover)")
    for r, host in zip(rec["dead_spares"], rec["dead_spare_hosts"]):
        if eng.mesh.rank == 0:
            faults.say(f"hpengine: the spare launch rank {r} on {host} died while it waited; the job goes on "
                       "without it")
    return eng


@contextlib.contextmanager
def saving(guard, step: int):
    """Around a checkpoint save of `step`: a failure inside it makes the recovery save that step again (guard:
    the Resilience, or None without one); yields the save's test hook (None: no kill)."""
    if guard is None:
        yield None
        return
    guard.saving = step
    yield guard.save_hook(step)
    guard.saving = -1


def _end_job(small, line: str) -> None:
    """Every survivor (collective on the shrunk world `small`): rank 0 says `line`, then all leave with exit
    status 2, the job's end as abort mode would end it."""
    if small.Get_rank() == 0:
        faults.say(line)
    supervisor.leaving(2)
    small.Barrier()             # the line is out before any rank leaves
    raise ulfm.JobEnds(2)


def _coords(c: dict) -> str:
    return f"dp{c['dp']} sh{c['sharding']} pp{c['pp']} tp{c['tp']}"


def rejoin(eng, cfg, world, setup, step: int, history: list, ends, root: int, open_metrics):
    """After a recovery, on every rank of the new mesh: the timers, progress and metrics file again (rank 0
    may be new), metrics.jsonl and the history trimmed to `step` (a step run again is recorded once); returns
    the history and `ends` (the loop's step saved last and stop request) as the survivor ranked `root` has them
    (open_metrics: the loop's opener of metrics.jsonl)."""
    if setup.metrics_f:
        setup.metrics_f.close()
    trim_metrics(setup.out, step, world.Get_rank())
    setup.metrics_f = open_metrics(setup.out, True) if world.Get_rank() == 0 else None
    setup.prog = progress.begin(eng, cfg, world, step, compute_dtype(cfg), log)
    setup.tracer = trace.attach(eng, cfg)
    history, (saved, stop) = world.bcast(([m for m in history if m["step"] <= step], ends), root=root)
    return history, saved, stop
