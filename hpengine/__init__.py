"""hpengine: an MPI training engine with switchable hybrid parallelism (NumPy on CPU, CuPy on GPU).
The Python API: `load_config`, `build` (this rank's Engine for a config), `Engine`, `train` (the whole
loop, as `hpengine train` runs it) and `__version__`.
"""
# Under an MPI launcher, before any module starts MPI,
# `hpengine train` forks into the rank and its supervisor (run/supervisor.py), and the start-up guard is
# armed, so a Ctrl-C while the ranks start aborts them all (run/startguard.py).
from hpengine.run import startguard as _startguard

if _startguard.under_launcher():
    _startguard.arm()             # first: an interrupt from here on is held until MPI is up

from hpengine.run import supervisor as _supervisor  # noqa: E402 - after the guard, before MPI starts

if _supervisor.wanted():
    _supervisor.supervise()       # returns in the rank; the supervisor exits with the rank's status

from importlib.metadata import PackageNotFoundError, version as _version  # noqa: E402
from hpengine.config import load_config  # noqa: E402 - after the guard: these start MPI
from hpengine.engine import Engine  # noqa: E402
from hpengine.run.build import build  # noqa: E402
from hpengine.run.train import train  # noqa: E402

try:
    __version__ = _version("hpengine")
except PackageNotFoundError:          # a source tree on sys.path without an install
    __version__ = "0.0.0+unknown"

__all__ = ["Engine", "build", "load_config", "train", "__version__"]
