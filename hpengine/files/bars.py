"""Progress bars of the long commands (eval, ckpt export, data build, generate): tqdm on standard error, drawn
only where a person watches (stderr is a terminal) and by one process (rank 0 under MPI). Redirected, they
stay silent and the command's own summary line is all it says. No MPI: callers pass their rank."""
from __future__ import annotations

import contextlib
import os
import sys
import threading

from tqdm import tqdm


RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def launcher_rank(env=None) -> int:
    """This process's rank as its MPI launcher set it in the environment; 0 without a launcher."""
    env = os.environ if env is None else env
    for var in RANK_VARS:
        if env.get(var, "").isdigit():
            return int(env[var])
    return 0


def watched(stream=None, rank: int = 0) -> bool:
    """Whether a bar on `stream` (default: standard error) is drawn: it is a terminal, and this process is
    rank 0 both of the communicator its caller uses (`rank`) and of the job its launcher started."""
    stream = sys.stderr if stream is None else stream
    if rank or launcher_rank():
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):          # replaced or closed stream
        return False


def bar(total, desc: str, unit: str = "it", show: bool | None = None, rank: int = 0, scale: bool = False,
        stream=None) -> tqdm:
    """A tqdm bar of `total` units (None: unknown) on `stream` (default: standard error at call time);
    show None: drawn where `watched`. It clears itself when closed, so the summary line stands alone.
    scale: k/M/G prefixes (bytes)."""
    stream = sys.stderr if stream is None else stream
    if show is None:
        show = watched(stream, rank)
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, file=stream, disable=not show,
                dynamic_ncols=True, leave=False, mininterval=0.25)


@contextlib.contextmanager
def following(b: tqdm, done, every: float = 0.25):
    """Moves bar `b` to done() (units finished so far) every `every` seconds while the block runs, and closes
    it after: for work whose loop lies in code that takes no bar (a library writing a file, polled by size)."""
    stop = threading.Event()

    def poll():
        while not stop.wait(every):
            try:
                now = done()
            except OSError:                       # a file being renamed or removed meanwhile
                continue
            if now > b.n:
                b.update(now - b.n)
    thread = None if b.disable else threading.Thread(target=poll, name="hpengine-progress", daemon=True)
    if thread:
        thread.start()
    try:
        yield b
    finally:
        stop.set()
        if thread:
            thread.join()
        b.close()
