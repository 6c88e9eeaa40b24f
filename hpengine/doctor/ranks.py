"""Device buffers through MPI on every rank, as training moves them: a device array allreduced over all ranks
through dist.comm.Comm (straight to MPI when the library says it is CUDA-aware, else through pinned host
staging), checked against the sum it must give. Collective: every rank calls it, and the ranks agree on what
they can do before any of them enters the allreduce.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from hpengine.device import backend
from hpengine.dist.comm import Comm, mpi_cuda_support
from hpengine.doctor.checks import FAILED, OK, SKIPPED, Check, reason

NAME = "MPI device buffers"
ELEMENTS = 1 << 20                # float32 values each rank sends (4 MiB)


def _ranks(flags) -> str:
    bad = [r for r, f in enumerate(flags) if f]
    return f"rank{'s' * (len(bad) > 1)} {', '.join(map(str, bad[:8]))}{' ...' if len(bad) > 8 else ''}"


def device_allreduce(world, elements: int = ELEMENTS) -> Check:
    """Each rank's array of (rank + 1)s summed over `world` in place; every element must be n (n + 1) / 2."""
    n = world.Get_size()
    if not all(world.allgather(backend.cupy_usable())):
        return Check(NAME, SKIPPED, "needs a CUDA device" + ("" if n == 1 else " on every rank"))
    if n == 1:
        return Check(NAME, SKIPPED, "one rank: `mpiexec -n 2 hpengine doctor` moves device buffers between ranks")
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    be, why = None, ""
    try:
        aware = mpi_cuda_support()
        be = backend.make_backend("cupy", "float32", node.Get_rank(), node.Get_size(), share_devices=True,
                                  cuda_aware=aware)
        x = be.xp.full(elements, world.Get_rank() + 1, dtype=np.float32)
    except Exception as e:  # noqa: BLE001 - agreed below, before the collective
        why = reason(e)
    finally:
        node.Free()
    failed = world.allgather(bool(why))
    if any(failed):
        first = world.bcast(why, root=failed.index(True))
        return Check(NAME, FAILED, f"{_ranks(failed)} could not set up a device array: {first}")
    try:
        Comm(world, "world", be).allreduce_(x)
        be.sync()
        bad = int(be.xp.count_nonzero(x != np.float32(n * (n + 1) // 2)))
        why = f"{bad} of {elements} elements wrong" if bad else ""
    except Exception as e:  # noqa: BLE001 - after the collective: reported, not raised
        why = reason(e)
    failed = world.allgather(bool(why))
    way = "straight to MPI (CUDA-aware)" if be.cuda_aware else f"through pinned host staging " \
          f"({be.staging.nbytes / 2**20:.0f} MiB)"
    if any(failed):
        first = world.bcast(why, root=failed.index(True))
        return Check(NAME, FAILED, f"an allreduce of {elements * 4 / 2**20:.0f} MiB {way}: {_ranks(failed)}: {first}")
    return Check(NAME, OK, f"{n} ranks allreduced {elements * 4 / 2**20:.0f} MiB of device memory {way}")
