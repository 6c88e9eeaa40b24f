"""say_once: one line for the job when every rank has the same message, else one per rank, each named."""
from mpi4py import MPI

from hpengine.dist.agree import say_once

WORLD = MPI.COMM_WORLD


def _said(message):
    out = []
    say_once(WORLD, "hpengine: ", message, out.append, wait_s=30.0)
    return [line for part in WORLD.allgather(out) for line in part]


def test_same_message_everywhere_is_said_once_by_rank_0():
    assert _said("error: bad key") == ["hpengine: error: bad key"]
    assert WORLD.allgather(len(_said("error: é"))) == [1] * WORLD.Get_size()


def test_messages_that_differ_name_each_rank():
    n = WORLD.Get_size()
    if n == 1:
        assert _said("error: x 0") == ["hpengine: error: x 0"]
        return
    got = _said(f"error: file missing on rank {WORLD.Get_rank()}" if WORLD.Get_rank() == n - 1 else "error: same")
    want = [f"hpengine: rank {r} of {n}: error: same" for r in range(n - 1)]
    want.append(f"hpengine: rank {n - 1} of {n}: error: file missing on rank {n - 1}")
    assert got == want

