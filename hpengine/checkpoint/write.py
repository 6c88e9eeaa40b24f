"""Writing a checkpoint (the format: shards.py): each rank's shard file, then rank 0's manifest, published
atomically (temporary folder, fsync, rename, then the `latest` pointer), and pruning to the newest few.
`save` is the synchronous whole; background.py runs the same SaveJob with the shard written by a thread.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import threading
from pathlib import Path

import h5py
import numpy as np

from hpengine.checkpoint import guard, seal
from hpengine.checkpoint.guard import STEP_NAME, CheckpointError
from hpengine.checkpoint.shards import FORMAT
from hpengine.dist.agree import agree_or_raise
from hpengine.files import UnsafeFile, fsync_folder, read_text, write_file

# A checkpoints folder records its run's id (OWNER) and each manifest the id of the run that wrote it: pruning
# deletes only `step_XXXXXXXX` folders of this run, never the newest, never anything else in the folder.
OWNER = ".hpengine-checkpoints"      # in a checkpoints folder: {"run": id} of the run whose checkpoints it holds


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _collective(comm, fn):
    """Run fn on every rank; if any rank fails, every rank raises CheckpointError with the first message."""
    return agree_or_raise(comm, fn, CheckpointError, (OSError, CheckpointError, KeyError, ValueError))


def _write_shard(path: Path, pieces) -> list[dict]:
    """The shard's HDF5 structure is written first (every dataset contiguous, its space allocated and left
    unfilled), then each piece's bytes go to its dataset's offset with plain pwrite calls: a full disk is an
    OSError there, not a failure inside HDF5's deferred writes, and the bulk of the work (sha256, the writes)
    runs outside the GIL, so a background writer leaves the training thread alone."""
    index, parts = [], []
    with h5py.File(path, "w") as f:
        for i, (name, kind, gshape, box, a, b, data) in enumerate(pieces):
            dset = f"{kind}/{i}"
            offset = f.create_dataset(dset, shape=data.shape, dtype=data.dtype, dcpl=_allocated()).id.get_offset()
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            index.append({"file": path.name, "dset": dset, "name": name, "kind": kind, "global_shape": list(gshape),
                          "box": [[s.start, s.stop] for s in box], "flat": [a, b], "dtype": str(data.dtype),
                          "sha256": hashlib.sha256(raw).hexdigest()})
            if raw.size:
                parts.append((offset, raw))
    guard.write_at(path, parts)
    return index


def _allocated():
    """Dataset creation: contiguous storage allocated at creation (so its file offset is known), never filled."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def save(world, root, step: int, keep: int, pieces: list, meta: dict, tracer, key: bytes | None = None,
         after_write=None) -> Path:
    """Collective over `world` (a comm.Comm): write this rank's `pieces` (state.checkpoint_pieces) of the
    checkpoint of `step` under root/step_XXXXXXXX; rank 0 writes the manifest (`meta`: config, state,
    shapes, layout, world; signed with `key`, else with the environment's key if one is set) and points
    `latest` at it. after_write: called once this rank's shard is written (fault injection)."""
    t_span = tracer.now()          # the save is one "checkpoint" span
    job = begin(world, root, step, pieces, key)

    def write():
        index = job.write(pieces)
        if after_write is not None:
            after_write()
        return index
    try:
        index = _collective(world, write)
    except CheckpointError:
        job.abandon()
        raise
    final = job.publish(keep, meta, index)
    tracer.lap("checkpoint", t_span, "save", step)
    return final


class SaveJob:
    """One checkpoint being written: its folders and the bytes the whole job writes. `write` is local (no
    MPI: a background writer may run it); `publish` and `abandon` are collective over `world`."""

    def __init__(self, world, root: Path, step: int, need: int, key: bytes | None = None):
        self.world, self.root, self.step, self.need, self.key = world, root, step, need, key
        self.final, self.tmp = root / f"step_{step:08d}", root / f".tmp-step_{step:08d}"
        self.run = None          # rank 0: the folder's run id (claim)

    def error(self, exc) -> CheckpointError:
        return guard.write_error(exc, self.root, self.step, self.need)

    def guarded(self, fn):
        def run():
            try:
                return fn()
            except (OSError, RuntimeError) as exc:       # h5py reports I/O errors as RuntimeError
                raise self.error(exc) from None
        return run

    def write(self, pieces) -> list[dict]:
        """This rank's shard file (none when another rank writes its share); its piece index. Local: no MPI."""
        if not pieces:
            return []
        try:
            return _write_shard(self.tmp / f"shard_r{self.world.rank:05d}.h5", pieces)
        except (OSError, RuntimeError) as exc:
            raise self.error(exc) from None

    def abandon(self) -> None:
        """Collective: give the space back; `latest` is untouched."""
        if self.world.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def publish(self, keep: int, meta: dict, index: list, prune_later: bool = False) -> Path:
        """Collective: gather every rank's piece index (this rank's: `index`) and publish the manifest, the
        folder and `latest`; prune to the `keep` newest (prune_later: their deletion in a thread)."""
        everything = [p for part in self.world.allgather_obj(index) for p in part]
        root, tmp, final = self.root, self.tmp, self.final

        def publish():
            if self.world.rank != 0:
                return
            manifest = seal.seal({"format": FORMAT, "step": self.step, "run": self.run, **meta,
                                  "pieces": everything}, self.key)
            try:
                guard.write_bytes(tmp / "manifest.json", json.dumps(manifest).encode())
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            _fsync_path(tmp)
            if os.path.lexists(final):
                if final.is_symlink() or not final.is_dir():
                    raise CheckpointError(f"'{final}' exists and is not a checkpoint folder of this run; "
                                          "move it away")
                guard.discard(final)
            os.replace(tmp, final)
            fsync_folder(root)
            write_file(root / "latest", final.name + "\n")    # last: a crash before here keeps the old one
            _prune(root, keep, self.run, final.name, prune_later)
        _collective(self.world, self.guarded(publish))
        return final


def begin(world, root, step: int, pieces: list, key: bytes | None = None) -> SaveJob:
    """Collective: the bytes the job will write, and rank 0's fresh temporary folder (after clearing what a
    killed save left and checking the free space), agreed on every rank."""
    job = SaveJob(world, Path(root), step, sum(world.allgather_obj(sum(p[-1].nbytes for p in pieces))),
                  key if key is not None else seal.load_key())

    def prepare():
        if world.rank == 0:
            job.root.mkdir(parents=True, exist_ok=True)
            job.run = claim(job.root)
            for stale in [*job.root.glob(".tmp-step_*"), *job.root.glob(guard.DISCARDED + "*")]:   # killed half-way
                if stale.is_symlink() or not stale.is_dir():
                    stale.unlink()
                else:
                    shutil.rmtree(stale, ignore_errors=True)
            guard.check_room(job.root, step, job.need)
            job.tmp.mkdir()
    _collective(world, job.guarded(prepare))
    return job


def run_of(root: Path) -> str | None:
    """The run id recorded in the checkpoints folder root (None: no marker yet)."""
    path = Path(root) / OWNER
    if not os.path.lexists(path):
        return None
    try:
        run = json.loads(read_text(path, "checkpoints folder marker", limit=4096)).get("run")
    except (UnsafeFile, ValueError, AttributeError) as exc:
        raise CheckpointError(f"'{path}' (the run that owns this checkpoints folder) is unreadable: {exc}; "
                              "checkpoint.dir holds something hpengine did not write") from None
    if not (isinstance(run, str) and run.isalnum()):
        raise CheckpointError(f"'{path}' records run {run!r}, not a run id; checkpoint.dir holds something "
                              "hpengine did not write")
    return run


def claim(root: Path) -> str:
    """Rank 0: the run id of the checkpoints folder root, recorded now when it has none."""
    run = run_of(root)
    if run is None:
        run = secrets.token_hex(8)
        try:
            write_file(root / OWNER, json.dumps({"run": run}) + "\n", overwrite=False)
        except UnsafeFile:            # another process recorded one first: that one holds
            return run_of(root)
    return run


def ours(root: Path, run: str) -> list[Path]:
    """The step folders of root that run `run` wrote (exact names, real folders, their manifest says so),
    oldest first."""
    found = []
    for p in sorted(root.iterdir()):
        if not STEP_NAME.fullmatch(p.name) or p.is_symlink() or not p.is_dir():
            continue
        try:
            who = json.loads(read_text(p / "manifest.json", "manifest", limit=1 << 30)).get("run")
        except (OSError, UnsafeFile, ValueError, AttributeError):
            continue                  # not readable as ours: never deleted
        if who == run:
            found.append(p)
    return found


def _prune(root: Path, keep: int, run: str, newest: str, later: bool = False) -> None:
    """Discard all but the `keep` newest step folders of this run (never `newest`, the one just published);
    later=True deletes the renamed folders in a thread (the next save's preparation also clears any it left)."""
    mine = ours(root, run)
    gone = []
    for old in [p for p in mine if p.name != newest][:max(0, len(mine) - keep)]:
        try:
            gone.append(guard.discard(old, remove=not later))
        except OSError:          # a folder that cannot be removed stays; the next save tries again
            pass
    if later and gone:
        threading.Thread(target=lambda: [shutil.rmtree(g, ignore_errors=True) for g in gone],
                         name="hpengine-prune", daemon=True).start()
