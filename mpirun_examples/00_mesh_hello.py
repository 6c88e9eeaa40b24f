"""Mesh hello: every rank finds its coordinates on a tp x dp mesh and the world ranks of its groups.

    mpiexec -n 4 python mpirun_examples/00_mesh_hello.py      # tp=2, dp = the ranks left over
"""
from mpi4py import MPI

from hpengine.dist.topology import Mesh

world = MPI.COMM_WORLD
tp = 2 if world.Get_size() % 2 == 0 else 1
mesh = Mesh(world, {"tp": tp, "sharding": 1, "dp": -1, "pp": 1})
groups = {axis: mesh.comms[axis].allgather(mesh.rank) for axis in ("tp", "dp")}
line = f"{mesh.prefix()} tp group {groups['tp']}, dp group {groups['dp']}"
lines = world.gather(line, root=0)
if mesh.rank == 0:
    print(mesh.describe())
    print("\n".join(lines))
