"""Not collected by default: run by tests/unit/test_launch.py to show that an assertion failing on one
rank ends the whole MPI job within seconds while the other ranks wait in a collective."""
from mpi4py import MPI


def test_one_rank_fails_others_wait():
    w = MPI.COMM_WORLD
    if w.Get_rank() == w.Get_size() - 1:
        assert 1 == 2, "deliberate failure on the last rank"
    w.Barrier()   # the other ranks wait here forever unless the failure aborts the job
