"""MPI's User-Level Failure Mitigation (ULFM) for a job that outlives a rank: whether this run has it, the
spare ranks' wait, revoking every communicator so that all ranks notice a failure, the shrunk world with a
spare put in each dead rank's place, and the communicators a recovery splits from it (the new mesh, a group).
Only Open MPI 5 started with `mpirun --with-ft ulfm` has it switched on.
"""
from __future__ import annotations

import os
import time

from mpi4py import MPI

from hpengine.dist.comm import Comm

FAILED = frozenset({MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED})
NEEDS = ("Open MPI 5 started with `mpirun --with-ft ulfm` (ULFM switched on at run time; MPICH, a plain mpirun "
         "and a direct srun have no failure notification)")


def missing(env=None) -> str:
    """Why this process cannot survive a rank's death ("" when it can): the library must be Open MPI 5 or later
    with ULFM switched on at run time, which `mpirun --with-ft ulfm` does by setting the MCA parameter
    mpi_ft_enable (OMPI_MCA_mpi_ft_enable in each rank's environment), and MPI_Comm_revoke must work."""
    env = os.environ if env is None else env
    lib = MPI.Get_library_version().splitlines()[0].strip()
    if not lib.startswith("Open MPI v"):
        return f"the MPI library is {lib.split(',')[0]!r}"
    major = lib[len("Open MPI v"):].split(".")[0]
    if not major.isdigit() or int(major) < 5:
        return f"the MPI library is {lib.split(',')[0]!r} (ULFM is built into Open MPI 5 and later)"
    if env.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() not in ("1", "true", "yes", "on", "enabled"):
        return "ULFM is not switched on (mpirun was started without --with-ft ulfm)"
    probe = MPI.COMM_SELF.Dup()
    try:
        probe.Revoke()
    except (NotImplementedError, MPI.Exception) as exc:
        return f"MPI_Comm_revoke fails here ({exc})"
    finally:
        probe.Free()
    return ""


def is_failure(exc: BaseException, world=None, grace_s: float = 5.0, comms=()) -> bool:
    """Whether exc may be MPI's report of a dead peer (or of a communicator revoked because of one). A wait on
    several requests reports MPI_ERR_IN_STATUS, and the process may not know yet of the death that caused it:
    it counts too (a recovery that finds every rank alive ends the job, on every rank). A collective that Open
    MPI runs as rounds of point-to-point messages (libnbc) reports a dead peer as MPI_ERR_OTHER: it counts when
    this process knows of a dead rank of `world`, or learns of one within grace_s (the notice of a death can
    come after the error it caused), or when one of `comms` is revoked (a peer began a recovery: libnbc reports
    the revoked communicator as MPI_ERR_OTHER too)."""
    if not isinstance(exc, MPI.Exception):
        return False
    kind = exc.Get_error_class()
    if kind in (*FAILED, MPI.ERR_IN_STATUS):
        return True
    if kind != MPI.ERR_OTHER or world is None:
        return False
    end = time.monotonic() + grace_s
    while not (knows_dead(world) or any(c != MPI.COMM_NULL and c.Is_revoked() for c in comms)):
        if time.monotonic() > end:
            return False
        try:
            world.Iprobe(source=world.Get_rank(), tag=0)      # keeps MPI progressing: the notice comes in
        except MPI.Exception:
            pass
        time.sleep(0.005)
    return True


def knows_dead(world) -> bool:
    """Whether this process knows of a dead rank of world (MPIX_Comm_get_failed; local, no communication)."""
    try:
        failed = world.Get_failed()
    except (NotImplementedError, MPI.Exception):      # a library without MPIX_Comm_get_failed
        return False
    try:
        return failed.Get_size() > 0
    finally:
        failed.Free()


def errors_return(comm) -> None:
    """Errors on comm come back as mpi4py exceptions instead of aborting (communicators split from it inherit it)."""
    comm.Set_errhandler(MPI.ERRORS_RETURN)


def revoke_all(comms) -> None:
    """Revoke every communicator in comms: each operation pending on any of them, on any rank, fails with
    MPI_ERR_REVOKED, so ranks that share no communicator with the dead one leave their collectives too and
    revoke theirs in turn (the notice spreads over the mesh)."""
    for c in comms:
        c = c.c if isinstance(c, Comm) else c
        if c is None or c == MPI.COMM_NULL:
            continue
        try:
            if not c.Is_revoked():
                c.Revoke()
        except MPI.Exception:         # already revoked, or freed under us: the notice has gone out
            pass


def split_spares(world, spares: int):
    """The compute ranks (world minus its last `spares` ranks, in world order) as a communicator; COMM_NULL on
    a spare. Collective on world."""
    n = world.Get_size()
    spare = world.Get_rank() >= n - spares
    return world.Split(MPI.UNDEFINED if spare else 0, world.Get_rank())


def wait_as_spare(world, poll_s: float = 0.005) -> bool:
    """A spare's wait: a barrier on world that the compute ranks enter only when the run ends (then False is
    returned) and that a revoked world interrupts (a rank died: True). A dead peer fails the barrier too; the
    spare then waits for the compute ranks to revoke the world (they do when the death is theirs to recover
    from; another spare's, at the run's end) and never starts a recovery alone."""
    try:
        world.Ibarrier().Wait()
        return False
    except MPI.Exception as exc:
        if not is_failure(exc, world):
            raise
    while not world.Is_revoked():
        try:
            world.Iprobe(source=world.Get_rank(), tag=0)      # keeps MPI progressing: the revoke's notice comes in
        except MPI.Exception:
            pass
        time.sleep(poll_s)
    return True


def release_spares(world) -> None:
    """The compute ranks' side of the spares' barrier, once the run is over (non-blocking, as the spares' is:
    MPI never matches a blocking collective with a non-blocking one)."""
    world.Ibarrier().Wait()


def shrink(world, place: int):
    """The world without its dead ranks (collective on every live rank of world, spares included), and
    every survivor's (old world rank, `place`) in new-world order. `place` is this rank's mesh place, -1 on a
    spare."""
    world.Ack_failed()          # the failures known here are acknowledged: the agreement below ignores them
    small = world.Shrink()
    errors_return(small)
    return small, small.allgather((world.Get_rank(), place))


def placed(small, members, places: int):
    """A new compute world from the shrunk world `small` (members: every survivor's (old rank, place) in
    small's order): each of the `places` mesh places keeps its survivor, each dead one goes to the next spare
    in order. Returns (the compute communicator, COMM_NULL on a rank left a spare; this rank's place or -1;
    the places that were empty, each with the old world rank of the spare now in it). Collective on small."""
    held = {p for _, p in members if p >= 0}
    empty = [p for p in range(places) if p not in held]
    spares = [old for old, p in members if p < 0]
    if len(spares) < len(empty):
        raise SpareError(f"{len(empty)} rank(s) died (mesh places {empty}) but only {len(spares)} spare(s) are left: "
                         "the job ends; start it with more resilience.spares, or resume it from its last checkpoint")
    given = dict(zip(spares, empty))
    me_old, me_place = members[small.Get_rank()]
    place = me_place if me_place >= 0 else given.get(me_old, -1)
    return mesh_of(small, place), place, [(p, old) for old, p in given.items()]


def mesh_of(small, place: int):
    """The compute communicator of the ranks of `small` that hold a mesh place (place >= 0), ranked by place;
    COMM_NULL on a rank with place -1 (it waits as a spare). Collective on small."""
    comm = small.Split(MPI.UNDEFINED if place < 0 else 0, place)
    if comm != MPI.COMM_NULL:
        errors_return(comm)
    return comm


def gather_in_group(small, group: int, order: int, obj) -> list:
    """obj of every rank of `small` in the same `group`, ranked by `order` ([] on a rank with group -1, which
    takes no part). Collective on small; the group's communicator lives only for this gather."""
    sub = small.Split(MPI.UNDEFINED if group < 0 else group, order)
    if sub == MPI.COMM_NULL:
        return []
    try:
        return sub.allgather(obj)
    finally:
        sub.Free()


class SpareError(RuntimeError):
    """More ranks died than spares are left."""


class JobEnds(Exception):
    """Every surviving rank leaves the job together with exit status `code`, its line already said. No
    collective may follow (the world holds a dead rank), and no MPI_Abort: under ULFM it was seen to hang."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code
