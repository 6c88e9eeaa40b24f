"""`hpengine doctor`'s MPI check on device buffers across ranks, on the CuPy stand-in (tests/unit/emulated_cupy.py):
a device array allreduced over every rank through the pinned host staging of the GPU path gives the sum; a rank
that cannot set up its array is named in one FAILED line on rank 0, and no rank waits in the collective."""
import sys
from pathlib import Path

from mpi4py import MPI

from helpers import need
from hpengine.device import backend
from hpengine.doctor import ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import emulated_cupy  # noqa: E402 - the stand-in lives beside the unit tests that check it

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()


def test_device_buffers_through_staged_mpi_on_the_stand_in(monkeypatch):
    need(N >= 2, "two or more ranks")
    emulated_cupy.install(monkeypatch)
    c = ranks.device_allreduce(WORLD, elements=4096)
    assert c.status == "ok" and c.detail.startswith(f"{N} ranks allreduced") and "pinned host staging" in c.detail, c


def test_a_rank_without_its_array_fails_the_check_on_every_rank(monkeypatch):
    need(N >= 2, "two or more ranks")
    emulated_cupy.install(monkeypatch)
    if WORLD.Get_rank() == N - 1:
        def broken(*args, **kw):
            raise backend.BackendError("CUDA device 0 is not usable (stand-in)")
        monkeypatch.setattr(backend, "make_backend", broken)
    c = ranks.device_allreduce(WORLD, elements=4096)
    assert c.failed and c.detail == f"rank {N - 1} could not set up a device array: BackendError: CUDA device 0 is " \
                                    "not usable (stand-in)", c


def test_one_rank_is_skipped_with_the_command_that_checks(monkeypatch):
    emulated_cupy.install(monkeypatch)
    c = ranks.device_allreduce(MPI.COMM_SELF, elements=4096)
    assert c.status == "skipped" and "mpiexec -n 2 hpengine doctor" in c.detail
