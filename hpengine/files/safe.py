"""Files stay in their folder: names read from a manifest, pointer or index are checked to stay inside it,
data files are opened without following a link and only when they are regular files (a FIFO never hangs a
reader), and every write goes through `write_file` (an exclusive temporary file, no link followed, fsync,
published by rename). `hold_lock` keeps a second job out of a folder. Plain os calls; no MPI."""
from __future__ import annotations

import errno
import fcntl
import os
import secrets
import socket
import stat
from pathlib import Path

_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


class UnsafeFile(ValueError):
    """A name that leaves its folder, a link, a FIFO or another non-regular file, or an existing file that
    would be overwritten; the message names the file and what would be accepted."""


def inside(folder, name, what: str, bare: bool = False) -> Path:
    """folder/name where `name` (read from a file: `what` says which entry) stays inside folder: a relative
    name without '..' (with bare=True a plain file name, no '/'), and no link on the way that leads out."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UnsafeFile(f"{what}: {name!r} is not a file name")
    if os.path.isabs(name) or name.startswith("~"):
        raise UnsafeFile(f"{what}: {name!r} is an absolute path; only names inside '{folder}' are read")
    parts = Path(name).parts
    if ".." in parts or (bare and (len(parts) != 1 or "/" in name or "\\" in name)):
        raise UnsafeFile(f"{what}: {name!r} leaves the folder '{folder}'; only "
                         + ("a bare file name is" if bare else "names inside it are") + " accepted")
    path = Path(folder) / name
    base = Path(folder).resolve()
    if not path.resolve().is_relative_to(base):
        raise UnsafeFile(f"{what}: {name!r} is a symbolic link (or passes through one) that leads out of "
                         f"'{folder}'; only files inside it are read")
    return path


def check_regular(path, what: str) -> os.stat_result:
    """lstat of path; refuses a symbolic link and anything that is not a regular file (FIFO, device, folder)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafeFile(f"{what}: '{path}' is missing (No such file or directory)") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFile(f"{what}: '{path}' is a symbolic link; data files are not read through links")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{what}: '{path}' is not a regular file ({_kind(st.st_mode)})")
    return st


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def open_regular(path, what: str):
    """A binary file object reading path, opened without following a final link and without blocking on a
    FIFO, refused unless it is a regular file."""
    try:
        fd = os.open(path, _OPEN_READ)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(f"{what}: '{path}' is a symbolic link; data files are not read through links") \
                from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{what}: '{path}' is not a regular file ({_kind(st.st_mode)})")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path, what: str, limit: int | None = None) -> bytes:
    """The bytes of a regular file (open_regular); refuses one larger than `limit` bytes."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise UnsafeFile(f"{what}: '{path}' is {size} bytes, more than the {limit} such a file can hold")
        return f.read()


def read_text(path, what: str, limit: int | None = None) -> str:
    """The UTF-8 text of a regular file (read_bytes); undecodable bytes are a ValueError naming the file."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what}: '{path}' is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def refuse_existing(path, what: str, hint: str = "pass --force to replace it") -> None:
    """Refuse when path exists (a dangling link included)."""
    if os.path.lexists(path):
        raise UnsafeFile(f"{what}: '{path}' already exists; {hint}")


def write_file(path, data, overwrite: bool = True, durable: bool = True) -> Path:
    """Write bytes (or str, as UTF-8) to path: a temporary file beside it created exclusively (never through
    a link), written, fsynced, then renamed onto path (a link at path is replaced, never followed).
    overwrite=False refuses an existing path (UnsafeFile), atomically where the file system has hard links."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not overwrite:
        refuse_existing(path, "output")
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, _CREATE, 0o666)                   # mode less the umask, as open() does
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
        else:
            _publish_new(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    if durable:
        fsync_folder(path.parent)
    return path


def _publish_new(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path, follow_symlinks=False)        # fails if path exists: no window to clobber it
    except FileExistsError:
        raise UnsafeFile(f"output: '{path}' already exists; pass --force to replace it") from None
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        refuse_existing(path, "output")
        os.replace(tmp, path)


def open_append(path, what: str):
    """A text file appended to (created when missing), never through a link and only a regular file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFile(f"{what}: '{path}' is not a regular file")
        return os.fdopen(fd, "a", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


def fsync_folder(folder) -> None:
    """fsync a folder, so renames inside it survive a crash (quietly skipped where folders cannot be synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def probe_writable(folder, tag: str) -> None:
    """Create (exclusively, under a fresh name) and remove one file in folder: an OSError says why not."""
    p = Path(folder) / f".probe-{tag}-{secrets.token_hex(4)}"
    fd = os.open(p, _CREATE, 0o666)
    try:
        os.write(fd, b"ok")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(p)


class Busy(Exception):
    """The folder's lock is held by another job; the message names the holder."""


def hold_lock(path, holder: str):
    """Take the exclusive lock file `path` (an open descriptor, kept until `release`), recording `holder`;
    Busy naming the current holder when another process has it. The kernel drops the lock when the holder
    dies, so a killed job never leaves a stale lock. Returns None where the file system has no locks."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFile(f"lock file '{path}' is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.lseek(fd, 0, os.SEEK_SET)
                held = os.read(fd, 4096).decode("utf-8", "replace").strip() or "another process"
                raise Busy(held) from None
            if exc.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                return None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode() + b"\n", 0)
        return fd
    except BaseException:
        if _is_open(fd):
            os.close(fd)
        raise


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def release(fd) -> None:
    """Give back a lock from hold_lock (None: nothing was held)."""
    if fd is not None:
        os.close(fd)


def holder_text(what: str) -> str:
    """Who holds a lock, for the message another job gets: host, process id, batch job id."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID")
    return f"{what} by process {os.getpid()} on {socket.gethostname()}" + (f" (batch job {job})" if job else "")
