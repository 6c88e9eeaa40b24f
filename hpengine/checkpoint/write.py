"""Writing a checkpoint (the format: shards.py): each rank's shard file, then rank 0's manifest, published
atomically (temporary folder, fsync, rename, then the `latest` pointer), and pruning to the newest few.
`save` is the synchronous whole; background.py runs the same SaveJob with the shard written by a thread.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import h5py
import numpy as np

from hpengine.checkpoint import guard
from hpengine.checkpoint.guard import CheckpointError
from hpengine.checkpoint.shards import FORMAT
from hpengine.dist.agree import agree_or_raise


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


def save(world, root, step: int, keep: int, pieces: list, meta: dict, tracer) -> Path:
    """Collective over `world` (a comm.Comm): write this rank's `pieces` (state.checkpoint_pieces) of the
    checkpoint of `step` under root/step_XXXXXXXX; rank 0 writes the manifest (`meta`: config, state,
    shapes, layout, world) and points `latest` at it."""
    t_span = tracer.now()          # the save is one "checkpoint" span
    job = begin(world, root, step, pieces)
    try:
        index = _collective(world, lambda: job.write(pieces))
    except CheckpointError:
        job.abandon()
        raise
    final = job.publish(keep, meta, index)
    tracer.lap("checkpoint", t_span, "save", step)
    return final


class SaveJob:
    """One checkpoint being written: its folders and the bytes the whole job writes. `write` is local (no
    MPI: a background writer may run it); `publish` and `abandon` are collective over `world`."""

    def __init__(self, world, root: Path, step: int, need: int):
        self.world, self.root, self.step, self.need = world, root, step, need
        self.final, self.tmp = root / f"step_{step:08d}", root / f".tmp-step_{step:08d}"

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
            manifest = guard.seal({"format": FORMAT, "step": self.step, **meta, "pieces": everything})
            try:
                guard.write_bytes(tmp / "manifest.json", json.dumps(manifest).encode())
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            _fsync_path(tmp)
            if final.exists():
                guard.discard(final)
            os.replace(tmp, final)
            _fsync_path(root)
            (root / "latest.tmp").write_text(final.name + "\n")
            _fsync_path(root / "latest.tmp")
            os.replace(root / "latest.tmp", root / "latest")   # updated last: a crash before here keeps the old one
            _fsync_path(root)
            _prune(root, keep, prune_later)
        _collective(self.world, self.guarded(publish))
        return final


def begin(world, root, step: int, pieces: list) -> SaveJob:
    """Collective: the bytes the job will write, and rank 0's fresh temporary folder (after clearing what a
    killed save left and checking the free space), agreed on every rank."""
    job = SaveJob(world, Path(root), step, sum(world.allgather_obj(sum(p[-1].nbytes for p in pieces))))

    def prepare():
        if world.rank == 0:
            job.root.mkdir(parents=True, exist_ok=True)
            for stale in [*job.root.glob(".tmp-step_*"), *job.root.glob(guard.DISCARDED + "*")]:   # killed half-way
                shutil.rmtree(stale, ignore_errors=True)
            guard.check_room(job.root, step, job.need)
            job.tmp.mkdir()
    _collective(world, job.guarded(prepare))
    return job


def _prune(root: Path, keep: int, later: bool = False) -> None:
    """Discard all but the `keep` newest step folders; later=True deletes the renamed folders in a thread (the
    next save's preparation also clears any it left)."""
    gone = []
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        try:
            gone.append(guard.discard(old, remove=not later))
        except OSError:          # a folder that cannot be removed stays; the next save tries again
            pass
    if later and gone:
        threading.Thread(target=lambda: [shutil.rmtree(g, ignore_errors=True) for g in gone],
                         name="hpengine-prune", daemon=True).start()


