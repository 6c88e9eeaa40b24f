"""Checkpoint guards: what keeps a bad checkpoint folder or a failing file system to one clear line.

- The manifest's checksum: `manifest_sha256`, the sha256 of the manifest's canonical JSON (sorted keys, no
  spaces) without that key, stored inside manifest.json. Readers refuse a mismatch naming the file. A
  manifest without the key (written before manifests were checksummed) still loads, with a warning: its
  step, optimizer state and piece index are then unverified, though every piece's data still is.
- The manifest's structure (pieces inside their tensors' shapes), so even an unchecksummed manifest that
  was edited fails with a message instead of an IndexError.
- Write failures (disk full, quota, file-size limit, a file where a folder should be, no permission)
  become one CheckpointError naming the checkpoint folder, and for space the bytes needed and free.
- `check_writable`: the collective start-up check that every rank can create files in the folder.
- `discard`: a step folder is renamed away before it is deleted, so a kill half-way through never leaves
  a `step_*` folder with a manifest and missing shards.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from math import prod
from pathlib import Path

from hpengine.dist.agree import agree_or_raise

SUM_KEY = "manifest_sha256"
# Read once, before any writer thread exists: os.umask can only be read by setting it, and a file another
# thread created in between would get the temporary mask.
UMASK = os.umask(0)
os.umask(UMASK)
SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
DISCARDED = ".discard-"          # prefix of step folders being deleted
log = logging.getLogger("hpengine")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


# --- the manifest ----------------------------------------------------------------------------------
def manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != SUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(manifest: dict) -> dict:
    """The manifest with its checksum added."""
    return {**manifest, SUM_KEY: manifest_digest(manifest)}


def check_manifest(manifest: dict, mpath: Path, kinds) -> None:
    """Refuse a manifest whose checksum does not match or whose piece index is impossible."""
    want = manifest.get(SUM_KEY)
    if want is None:
        log.warning("manifest '%s' has no checksum (written before manifests were checksummed): its step, "
                    "state and piece index are not verified", mpath)
    elif manifest_digest(manifest) != want:
        raise CheckpointError(f"manifest '{mpath}' does not match its checksum ({SUM_KEY}): it was edited or "
                              "corrupted; use another checkpoint")
    try:
        _check_structure(manifest, kinds)
    except (KeyError, TypeError, ValueError, AssertionError) as exc:
        raise CheckpointError(f"manifest '{mpath}' is malformed: {exc or type(exc).__name__}") from None


def _check_structure(m: dict, kinds) -> None:
    int(m["step"])
    int(m["state"]["opt_steps"])
    shapes = m["shapes"]
    for i, p in enumerate(m["pieces"]):
        what = f"piece {i} ({p['kind']} of {p['name']})"
        if p["kind"] not in kinds or p["name"] not in shapes:
            raise ValueError(f"{what}: unknown kind or tensor")
        g, box, (a, b) = p["global_shape"], p["box"], p["flat"]
        if len(box) != len(g) or len(g) != len(shapes[p["name"]]) or not all(
                0 <= lo < hi <= n for (lo, hi), n in zip(box, g)):
            raise ValueError(f"{what}: box {box} does not fit global shape {g}")
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < b <= prod(hi - lo for lo, hi in box)):
            raise ValueError(f"{what}: flat range {[a, b]} does not fit its box {box}")


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


def _kept(root: Path) -> str:
    try:
        return f"'latest' still names {(root / 'latest').read_text().strip()}"
    except OSError:
        return "no earlier checkpoint exists"


def space_error(root: Path, step: int, need: int, why: str) -> CheckpointError:
    free = free_bytes(root)
    return CheckpointError(
        f"checkpoint folder '{root}' (checkpoint.dir): no room for the checkpoint of step {step} ({why}): it "
        f"needs about {_mib(need)}, {'?' if free is None else _mib(free)} free there; {_kept(root)}. Free "
        "space or set checkpoint.dir to a larger file system")


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
    """Write a whole file with plain os calls (so a full disk is an OSError here, never a failure deferred
    to a library's cleanup) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)       # less the umask, as open() does
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
    fd = os.open(path, os.O_WRONLY)
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
        p = root / f".probe-r{rank:05d}"
        try:
            write_bytes(p, b"ok")
            p.unlink()
        except OSError as exc:
            raise refuse(exc) from None
    agree_or_raise(comm, make, CheckpointError, (CheckpointError,))
    agree_or_raise(comm, probe, CheckpointError, (CheckpointError,))
