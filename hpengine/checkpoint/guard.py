"""Checkpoint guards: what keeps a bad checkpoint folder or a failing file system to one clear line:
write failures as one CheckpointError, the collective `check_writable`, and `discard`.
The manifest's checksum and MAC: seal.py.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path

from hpengine.checkpoint.seal import CheckpointError
from hpengine.dist.agree import agree_or_raise
from hpengine.files import UnsafeFile, probe_writable, read_text

# Read once, before any writer thread exists: os.umask can only be read by setting it, and a file another
# thread created in between would get the temporary mask.
UMASK = os.umask(0)
os.umask(UMASK)
SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
STEP_NAME = re.compile(r"step_\d{8}")      # the only names a checkpoint's step folders have
DISCARDED = ".discard-"          # prefix of step folders being deleted
log = logging.getLogger("hpengine")


# --- write failures --------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def free_bytes(path: Path) -> int | None:
    """Free bytes of the file system holding path (its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _errno_of(exc: BaseException) -> int | None:
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    hit = re.search(r"errno = (\d+)", str(exc))         # h5py's RuntimeError text
    return int(hit.group(1)) if hit else None


def read_latest(root: Path) -> str:
    """The step folder name that root/latest holds: a regular file naming a `step_XXXXXXXX` folder of root
    (nothing else is accepted, so the pointer cannot lead out of root)."""
    where = f"'{Path(root) / 'latest'}'"
    try:
        name = read_text(Path(root) / "latest", "checkpoint pointer", limit=4096).strip()
    except UnsafeFile as exc:
        raise CheckpointError(str(exc)) from None
    except ValueError as exc:
        raise CheckpointError(f"{where} is not a text pointer: {exc}") from None
    if not STEP_NAME.fullmatch(name):
        raise CheckpointError(f"{where} names {name[:80]!r}, not a step folder of its own folder (step_ and 8 "
                              "digits); it was edited or corrupted")
    return name


def _kept(root: Path) -> str:
    try:
        return f"'latest' still names {read_latest(root)}"
    except (OSError, CheckpointError):
        return "no earlier checkpoint exists"


def space_error(root: Path, step: int, need: int, why: str) -> CheckpointError:
    free = free_bytes(root)
    return CheckpointError(
        f"checkpoint folder '{root}' (checkpoint.dir): no room for the checkpoint of step {step} ({why}): it "
        f"needs about {_mib(need)}, {'?' if free is None else _mib(free)} free there; {_kept(root)}. Free "
        "space or set checkpoint.dir to a larger file system")


# Write failures (disk full, quota, file-size limit, a file where a folder should be, no permission)
# become one CheckpointError naming the checkpoint folder, and for space the bytes needed and free.
def write_error(exc: BaseException, root: Path, step: int, need: int) -> CheckpointError:
    """One line for an exception raised while saving into root."""
    code = _errno_of(exc)
    if code in SPACE_ERRNOS:
        return space_error(root, step, need, f"{os.strerror(code)}, errno {code}")
    if isinstance(exc, OSError):
        why = f"{exc.strerror or exc}" + (f": '{exc.filename}'" if exc.filename else "")
        if code == errno.ENOTDIR or isinstance(exc, FileExistsError):
            why += f" ({_blocker(root)})"
    else:
        why = str(exc).split("\n")[0]
    return CheckpointError(f"checkpoint folder '{root}' (checkpoint.dir): cannot save the checkpoint of step "
                           f"{step}: {why}; {_kept(root)}")


def _blocker(root: Path) -> str:
    p = Path(root)
    for q in [p, *p.parents]:
        if q.exists() and not q.is_dir():
            return f"'{q}' is a file, not a folder"
    return "a path component is not a folder"


def check_room(root: Path, step: int, need: int) -> None:
    """Refuse before writing anything when the file system clearly lacks the room."""
    free = free_bytes(root)
    if free is not None and free < need:
        raise space_error(root, step, need, "not enough free space")


def write_bytes(path: Path, data) -> None:
    """Write a new file with plain os calls (so a full disk is an OSError here, never a failure deferred
    to a library's cleanup) and fsync it; created exclusively, never through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)   # less the umask
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_at(path: Path, parts) -> None:
    """Write each (offset, byte array) of `parts` into the existing file `path` with plain pwrite calls (a full
    disk is an OSError here; large writes run outside the GIL) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        for offset, data in parts:
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        os.fsync(fd)
    finally:
        os.close(fd)


def as_created(path) -> None:
    """Give a file that a library created 0600 (safetensors does) the mode of a normally created file."""
    os.chmod(path, 0o666 & ~UMASK)


# `discard`: a step folder is renamed away before it is deleted, so a kill half-way through never leaves
# a `step_*` folder with a manifest and missing shards.
#
# --- folders ---------------------------------------------------------------------------------------
def discard(folder: Path, remove: bool = True) -> Path:
    """Delete a step folder: renamed away first (atomic), so a kill leaves no half-deleted step_* folder;
    remove=False leaves the renamed folder (returned) for the caller to delete later."""
    gone = folder.with_name(DISCARDED + folder.name)
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(folder, gone)
    if remove:
        shutil.rmtree(gone, ignore_errors=True)
    return gone


# `check_writable`: the collective start-up check that every rank can create files in the folder.
def check_writable(comm, root) -> None:
    """Collective over comm (mpi4py or comm.Comm): every rank can create a file in the checkpoint folder
    `root` (rank 0 creates the folder). Fails on every rank together with one line naming the folder."""
    root = Path(root)
    rank = comm.Get_rank() if hasattr(comm, "Get_rank") else comm.rank

    def refuse(exc):
        why = f"{exc.strerror or exc}" + (f" ({_blocker(root)})" if exc.errno in (errno.ENOTDIR, errno.EEXIST)
                                            else "")
        return CheckpointError(f"checkpoint folder '{root}' (checkpoint.dir) is not writable: {why}; set "
                               "checkpoint.dir to a folder every rank can write")

    def make():
        if rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise refuse(exc) from None

    def probe():
        try:
            probe_writable(root, f"r{rank:05d}")
        except OSError as exc:
            raise refuse(exc) from None
    agree_or_raise(comm, make, CheckpointError, (CheckpointError,))
    agree_or_raise(comm, probe, CheckpointError, (CheckpointError,))
