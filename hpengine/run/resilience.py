"""A job that outlives a rank (resilience.on_failure = "spare", over ULFM): the start-up that holds the spares
idle, the buddy copies after every step, and the recovery: every communicator revoked, the world shrunk, a spare
in the dead rank's mesh place, the engine built again, its state from the buddy copies, the step run again.
"""
from __future__ import annotations

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
from hpengine.run.launch import LaunchError

log = logging.getLogger("hpengine")
KILL_VAR = "HPENGINE_FAULT_KILL"      # tests: "WORLD_RANK@STEP,...": that process SIGKILLs itself as step STEP begins


def kill_plan(env=None) -> dict:
    """{world rank: step} from HPENGINE_FAULT_KILL ("1@3,4@5"); the fault injection of the resilience tests."""
    text = (os.environ if env is None else env).get(KILL_VAR, "").strip()
    plan = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        rank, _, step = item.partition("@")
        if not (rank.isdigit() and step.isdigit()):
            raise LaunchError(f"{KILL_VAR} = {text!r}: give WORLD_RANK@STEP items separated by commas, e.g. 1@3")
        plan[int(rank)] = int(step)
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
        self.kill_at = kill_plan().get(self.origin)
        self.places = n - spares                      # the mesh's ranks: place p is world rank p at launch
        self.hosts = self.world.allgather(socket.gethostname())[:self.places]     # the node of each place
        self.compute = ulfm.split_spares(self.world, spares)
        self.place = -1 if self.compute == MPI.COMM_NULL else self.compute.Get_rank()
        self.buddies = self._buddies()
        self.recovery = None        # the last recovery's record, until the step after it completes

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
        if self.kill_at == step + 1:
            log.warning("fault injection (%s): launch rank %d SIGKILLs itself as step %d begins, at unix time %.3f",
                        KILL_VAR, self.origin, step + 1, time.time())
            for h in log.handlers:
                h.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def commit(self, eng, steps: int) -> None:
        """This rank's state after `steps` optimizer steps, kept here and on its buddy (collective)."""
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
        return ulfm.is_failure(exc)

    def survivor(self) -> int:
        """The compute rank of the lowest mesh place that survived the last recovery (its history is the run's)."""
        dead = set(self.recovery["dead_ranks"]) if self.recovery else set()
        return min(p for p in range(self.places) if p not in dead)

    def copy_bytes(self) -> int:
        return self.buddies.nbytes() if self.buddies else 0

    def release(self) -> None:
        """The run is over: the spares still waiting are let go (collective on the world)."""
        ulfm.release_spares(self.world)

    # --- a failure ---------------------------------------------------------------------------------------
    def wait(self) -> bool:
        """A spare's wait; True when a rank died (then recover()), False when the run ended without it."""
        return ulfm.wait_as_spare(self.world)

    def recover(self, comms=()):
        """Every live rank (spares too) after a failure: revokes `comms` and the world, shrinks it, puts a spare
        in each dead rank's place and hands each rank its state at the newest step every survivor holds.
        Returns (step, arrays, facts) to build and fill this rank's engine from, or None on a rank left a
        spare (it waits again). self.recovery then describes it (dead places, their hosts, the spares)."""
        self.t_failed = time.perf_counter()
        ulfm.revoke_all([*comms, self.compute, self.world])
        held = (self.buddies.latest(), self.buddies.shift) if self.buddies else (-1, 0)
        small, members = ulfm.shrink(self.world, (self.place, *held, socket.gethostname(), self.origin))
        self.world = small
        alive = [m for m in members if m[1][0] >= 0]
        step = min(s for _, (_, s, *_) in alive)
        shift = alive[0][1][2]
        compute, place, filled = ulfm.placed(small, [(o, p) for o, (p, *_) in members], self.places)
        dead = sorted(p for p, _ in filled)
        if not dead:          # the same membership everywhere: every rank raises together
            raise ulfm.SpareError("an MPI error stopped a step but every rank is alive: it was not a failure")
        dead_hosts = [self.hosts[p] for p in dead]
        mine = self._hand_over(compute, place, dead, step, shift) if compute != MPI.COMM_NULL else None
        self.compute, self.place = compute, place
        for _, (p, _, _, host, _) in members:
            if p >= 0:
                self.hosts[p] = host
        spare_host = {o: h for o, (_, _, _, h, _) in members}
        launch_rank = {o: lr for o, (*_, lr) in members}
        for p, o in filled:
            self.hosts[p] = spare_host[o]
        self.buddies = self._buddies()
        self.recovery = {"recovered_step": step + 1,
                         "dead_ranks": dead, "dead_hosts": dead_hosts,
                         "spare_ranks": [launch_rank[o] for _, o in sorted(filled)]}
        return None if mine is None else (step, *mine)

    def _hand_over(self, compute, place: int, dead: list, step: int, shift: int):
        """(arrays, facts) of this rank at `step`: its own copy, or (a spare now in a dead place) the copy its
        buddy kept, sent over the new compute communicator."""
        holders = {p: (p + shift) % self.places for p in dead}
        lost = [p for p, h in holders.items() if h in dead]
        if lost:
            raise ulfm.SpareError(f"mesh places {lost} died together with the places holding their buddy copies "
                                  f"({[holders[p] for p in lost]}): the job ends; resume it from its last checkpoint")
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
