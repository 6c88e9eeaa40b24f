"""All-reduce on NumPy and CuPy buffers, the way hpengine hands arrays to MPI.

    mpiexec -n 2 python mpirun_examples/08_allreduce_buffers.py

NumPy arrays go to MPI as they are. A CuPy array goes as it is only when the MPI is CUDA-aware;
otherwise the backend copies it to a pinned host mirror (stage_out) and back (stage_in).
"""
import numpy as np
from mpi4py import MPI

from hpengine.device.backend import cupy_usable, make_backend
from hpengine.dist.topology import node_ranks

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
want = size * (size + 1) / 2                              # sum over ranks of (rank + 1)

a = np.full(4, rank + 1.0, dtype=np.float32)
world.Allreduce(MPI.IN_PLACE, a)
report = [f"numpy: {a.tolist()} (expected {want} everywhere: {bool(np.all(a == want))})"]

local_rank, local_size = node_ranks(world)               # collective: every rank calls it
if cupy_usable():
    be = make_backend("cupy", "float32", local_rank, local_size, share_devices=True)
    x = be.xp.full(4, rank + 1.0, dtype=be.xp.float32)
    buf = be.stage_out(x)                                 # x itself with a CUDA-aware MPI
    world.Allreduce(MPI.IN_PLACE, buf)
    be.stage_in(buf, x)
    how = "device buffer" if buf is x else "pinned host mirror"
    report.append(f"cupy ({how}, device {be.device}): {x.tolist()} (expected {want}: {bool((x == want).all())})")
else:
    report.append("cupy: skipped (CuPy not installed or no CUDA device visible)")
if rank == 0:
    print("\n".join(report))
