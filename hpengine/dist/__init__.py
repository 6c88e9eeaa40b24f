"""Communication: Comm (comm.py, the only mpi4py calls on arrays), failing together (agree.py), the mesh and
its communicators by name (topology.py), the hang watchdog (watchdog.py), the phase timers every
communicator reports to (tracer.py) and their NCCL twins (nccl.py).
Exports: Comm, Mesh, agree_or_raise, Tracer."""
from hpengine.dist.comm import Comm
from hpengine.dist.agree import agree_or_raise
from hpengine.dist.topology import Mesh
from hpengine.dist.tracer import Tracer

__all__ = ["Comm", "Mesh", "agree_or_raise", "Tracer"]
