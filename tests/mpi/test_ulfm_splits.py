"""The communicators a ULFM recovery splits from the shrunk world (dist/ulfm.py), on any world size: the new mesh
ranked by mesh place, a gather inside groups; and which MPI errors count as a dead peer. The splits need no ULFM:
plain MPI, no rank dies."""
from __future__ import annotations

from mpi4py import MPI

from hpengine.dist import ulfm


def test_the_new_mesh_ranks_the_placed_ranks_by_place_and_leaves_the_others_out():
    w = MPI.COMM_WORLD
    n, r = w.Get_size(), w.Get_rank()
    place = -1 if n > 1 and r == 0 else n - 1 - r       # rank 0 waits as a spare; the others in reverse order
    comm = ulfm.mesh_of(w, place)
    if place < 0:
        assert comm == MPI.COMM_NULL
        return
    assert (comm.Get_rank(), comm.Get_size()) == (place, n - 1 if n > 1 else 1)
    comm.Free()


def test_a_gather_in_groups_holds_each_groups_members_in_order_and_nothing_outside():
    w = MPI.COMM_WORLD
    n, r = w.Get_size(), w.Get_rank()
    assert ulfm.gather_in_group(w, r % 2, n - r, r) == sorted(range(r % 2, n, 2), reverse=True)
    got = ulfm.gather_in_group(w, -1 if r == 0 else 0, r, r)
    assert got == ([] if r == 0 else list(range(1, n)))


def test_mpi_err_other_counts_as_a_dead_peer_only_where_a_rank_is_known_dead():
    other = MPI.Exception(MPI.ERR_OTHER)
    # every rank is alive: no death becomes known within the grace
    assert not ulfm.is_failure(other) and not ulfm.is_failure(other, MPI.COMM_WORLD, grace_s=0.05)
    assert ulfm.is_failure(MPI.Exception(MPI.ERR_PROC_FAILED)) and ulfm.is_failure(MPI.Exception(MPI.ERR_REVOKED))
    assert not ulfm.is_failure(RuntimeError("not MPI")) and not ulfm.knows_dead(MPI.COMM_WORLD)
