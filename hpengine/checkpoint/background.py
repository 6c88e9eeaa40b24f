"""Asynchronous checkpoints (`checkpoint.async`): a save returns as soon as its folder is prepared, and a
background thread of each rank writes that rank's shard while training goes on. The manifest is published
only once every rank's writer has finished. Owns the Saver and the snapshot of the pieces it writes.
"""
from __future__ import annotations

import shutil
import threading
import time

import numpy as np

from hpengine.checkpoint import write
from hpengine.checkpoint.guard import CheckpointError
from hpengine.dist.watchdog import note_progress

IDLE, WRITING, FAILED = 0, 1, 2      # a writer's state as the step-boundary agreement carries it (max wins)
ABANDON_WAIT_S = 300.0       # how long a run ending on an error waits for its writer (the watchdog's save floor)


# The manifest is published
# only once every rank's writer has finished, which the ranks learn from the state they add to the
# step-boundary agreement they make anyway (train.py: launch.step_boundary), so finishing costs no extra
# collective and never waits for a slow disk. At most one save is in flight; the next save, the end of the run
# and a stop wait for it. A writer's failure reaches every rank at the next step boundary as one
# CheckpointError; its half-written folder is removed and `latest` still names the previous checkpoint. A run
# that ends on an error abandons the save in flight (`abandon`): its writer is let finish first, since a thread
# left inside h5py when the interpreter exits hangs or crashes the process.
#
# A thread rather than a process: the data are already in this process, and the copies,
# sha256, the write and fsync run outside the GIL (only the shard image's assembly in h5py holds it).
class Saver:
    """The save in flight of one job (collective methods are marked). `tracer` times the visible part."""

    def __init__(self, world, tracer, log):
        self.world, self.tracer, self.log = world, tracer, log
        self.job = self.thread = None
        self.copied = threading.Event()
        self.copied.set()
        self.index, self.failure = None, None
        self.keep = self.meta = None
        self.buffers = []            # the last snapshot's arrays, reused by the next (no new pages to fault in)
        self.warming = None
        self.t_begin = self.visible_s = 0.0

    # --- the training thread -------------------------------------------------------------------------
    def warm(self, pieces: list) -> None:
        """Allocate and touch the snapshot's arrays for pieces like these in a thread, while the first steps
        train: the first save then copies into memory already mapped (touching fresh memory can cost more
        than a step, notably in a virtual machine)."""
        def touch():
            try:
                bufs = [np.empty_like(p[-1]) for p in pieces]
                for b in bufs:
                    b.fill(0)
            except MemoryError:      # the first save allocates them then (and reports what it cannot)
                return
            self.buffers = bufs
        self.warming = threading.Thread(target=touch, name="hpengine-checkpoint-warm", daemon=True)
        self.warming.start()

    def start(self, root, step: int, keep: int, pieces: list, meta: dict, live: bool = True) -> None:
        """Collective: wait for the save in flight, prepare this one (agreed) and start its writer. `live`:
        the pieces view buffers that training changes (copied before the fence opens)."""
        self.wait()
        t0, span = time.perf_counter(), self.tracer.now()
        self.job = write.begin(self.world, root, step, pieces)
        self.keep, self.meta, self.index, self.failure = keep, meta, None, None
        self.copied.clear()
        self.thread = threading.Thread(target=self._write, args=(self.job, pieces, live), name="hpengine-checkpoint",
                                       daemon=True)     # an aborting job does not wait for it
        self.t_begin = t0
        self.thread.start()
        self.visible_s = time.perf_counter() - t0
        self.tracer.lap("checkpoint", span, "save (async)", step)

    def fence(self) -> None:
        """Before the buffers the pieces view change: wait until the writer has read them."""
        if not self.copied.is_set():
            t0, span = time.perf_counter(), self.tracer.now()
            self.copied.wait()
            self.visible_s += time.perf_counter() - t0
            self.tracer.lap("checkpoint", span, "snapshot wait")

    def state(self) -> int:
        """This rank's writer: IDLE (none in flight or finished), WRITING or FAILED."""
        if self.job is None:
            return IDLE
        if self.thread.is_alive():
            return WRITING
        return FAILED if self.failure is not None else IDLE

    def settle(self, agreed: int) -> None:
        """Collective (every rank passes the same agreed state, the maximum of every rank's `state()`):
        publish the save in flight when every writer has finished, or report a failure on any rank."""
        if self.job is None or agreed == WRITING:
            return
        self.wait()

    def wait(self) -> None:
        """Collective: let this rank's writer finish, then publish the save in flight (or raise every rank's
        first failure as one CheckpointError, after removing the half-written folder)."""
        if self.job is None:
            return
        job, thread = self.job, self.thread
        if thread.is_alive():
            t0, span = time.perf_counter(), self.tracer.now()
            thread.join()
            self.visible_s += time.perf_counter() - t0
            self.tracer.lap("checkpoint", span, "writer wait")
        self.job = self.thread = None
        written_s = time.perf_counter() - self.t_begin
        failures = [f for f in self.world.allgather_obj(self.failure) if f is not None]
        if failures:
            job.abandon()
            raise CheckpointError(failures[0])
        t0, span = time.perf_counter(), self.tracer.now()
        path = job.publish(self.keep, self.meta, self.index, prune_later=True)
        self.visible_s += time.perf_counter() - t0
        self.tracer.lap("checkpoint", span, "publish", job.step)
        self.log.info("checkpoint step %d -> %s (asynchronous: %.2f s of training time, written in %.2f s)",
                      job.step, path, self.visible_s, written_s)

    def abandon(self, wait_s: float = ABANDON_WAIT_S) -> None:
        """Not collective (an error may have stopped this rank alone): drop the save in flight, never to be
        published (`latest` still names the previous checkpoint), once this rank's writer has finished (at
        most wait_s seconds); rank 0 removes its folder (else the next save does)."""
        job, thread, self.job, self.thread = self.job, self.thread, None, None
        for t in (self.warming, thread):
            if t is not None:
                t.join(wait_s)
        if job is None:
            return
        if thread.is_alive():
            self.log.warning("checkpoint step %d: its background writer is still busy after %.0f s; ending without "
                             "it", job.step, wait_s)
        elif self.world.rank == 0:
            shutil.rmtree(job.tmp, ignore_errors=True)

    # --- the writer thread ---------------------------------------------------------------------------
    def _write(self, job, pieces, live) -> None:
        try:
            if live:
                if self.warming is not None:
                    self.warming.join()
                pieces = snapshot(pieces, self.buffers)
                self.buffers = [p[-1] for p in pieces]
            self.copied.set()
            self.index = job.write(pieces)
        except CheckpointError as exc:
            self.failure = str(exc)
        except Exception as exc:  # noqa: BLE001 - whatever stops the writer must reach the ranks as a line
            self.failure = f"checkpoint step {job.step}: the background writer failed: {exc!r}"
        finally:
            self.copied.set()           # the fence never waits for a writer that has stopped


# On the CPU the pieces are views of the live buffers: the writer's first act is to copy them, and the engine
# calls `fence()` before it changes the parameters or the optimizer's state (the next step's update), so the
# snapshot is taken while the next step's forward and backward run. On a GPU they are pinned host copies
# made at the save step.
def snapshot(pieces: list, buffers: list) -> list:
    """The pieces with their arrays copied (NumPy copies large arrays outside the GIL), into `buffers` (the
    previous snapshot's arrays) where they match, so that only the first save touches fresh memory."""
    if len(buffers) != len(pieces) or any(b.shape != p[-1].shape or b.dtype != p[-1].dtype
                                          for b, p in zip(buffers, pieces)):
        buffers = [np.empty_like(p[-1]) for p in pieces]
    for b, p in zip(buffers, pieces):
        np.copyto(b, p[-1])
        note_progress(b.nbytes)      # the watchdog sees a long snapshot move
    return [(*p[:-1], b) for p, b in zip(pieces, buffers)]
