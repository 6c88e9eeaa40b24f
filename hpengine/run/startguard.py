"""A Ctrl-C while the ranks are still starting (importing, inside MPI_Init) must not strand the others:
under a launcher the command line installs this SIGINT handler first (`arm`), which only notes an
interrupt until MPI is up (`mpi_ready`).
"""
from __future__ import annotations

import os
import signal
import sys
import threading

LAUNCHER_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "SLURM_STEP_ID")
_state = {"pending": False, "armed": False, "caught": False}


def under_launcher(env=os.environ) -> bool:
    """Whether an MPI launcher started this process (read from its environment: no MPI import)."""
    return any(k in env for k in LAUNCHER_VARS)


def _mpi_up() -> bool:
    """MPI is initialised (False while mpi4py.MPI is still importing: its module exists half-made)."""
    mod = sys.modules.get("mpi4py.MPI")
    try:
        return mod is not None and bool(mod.Is_initialized()) and not bool(mod.Is_finalized())
    except AttributeError:
        return False


# Python's default SIGINT handler raises KeyboardInterrupt; a rank that gets it before MPI is up exits on its
# own, and its peers then wait inside MPI_Init for it forever (Hydra's proxy does not always end them). Under
# a launcher the command line therefore installs this handler first: until mpi4py has initialised MPI an
# interrupt is only noted, and the rank goes on into MPI_Init with the others; `mpi_ready()`, called once MPI
# is up, raises the KeyboardInterrupt then, and the command line's handler aborts the whole job with 130
# (MPI_Abort reaches every rank). An interrupt after MPI is up but before the command line is ready to catch
# it (the rest of the imports, the argument parser) aborts the job from the handler. After that, SIGINT
# raises at once, as usual, until the training loop takes it over for its agreed stop at the step boundary
# (launch.install_stop_handlers).
def _on_sigint(signum, frame):
    if not _mpi_up():
        _state["pending"] = True    # raised by mpi_ready(), when an abort can reach every rank
        return
    world = sys.modules["mpi4py.MPI"].COMM_WORLD
    if _state["caught"] or world.Get_size() == 1:
        if swallowed(frame):      # raised here it would be printed and dropped: deliver it again once out of it
            os.kill(os.getpid(), signal.SIGINT)
            return
        raise KeyboardInterrupt
    # nobody would catch it yet: this rank would exit alone and leave its peers in a collective
    sys.stderr.write(f"hpengine: rank {world.Get_rank()} of {world.Get_size()}: interrupted while starting; "
                     "aborting the job\n")
    sys.stderr.flush()
    world.Abort(130)


def swallowed(frame) -> bool:
    """Whether an exception raised in `frame` would be printed as "Exception ignored" and dropped: a weakref
    callback or a finalizer, which the interpreter runs between two bytecodes of other code."""
    code = frame.f_code if frame is not None else None
    return code is not None and (code.co_name == "__del__" or code.co_filename.endswith(("weakref.py", "_weakrefset.py")))


def caught() -> None:
    """The command line catches KeyboardInterrupt from here on (and ends every rank itself)."""
    _state["caught"] = True


def arm() -> bool:
    """Install the start-up handler (main thread only); returns whether it is installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGINT, _on_sigint)
    _state["armed"] = True
    return True


def mpi_ready() -> None:
    """Call once MPI is initialised: an interrupt noted during start-up is raised now."""
    if _state["pending"]:
        _state["pending"] = False
        raise KeyboardInterrupt
