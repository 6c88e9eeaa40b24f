"""MPI test harness: the same suite runs under `mpiexec -n 1, 2, 4`. A failure on any rank aborts the
whole job at once (the other ranks may be waiting in a collective), so a failure never hangs.
Tests read the world size; layouts that do not fit skip on every rank together."""
import os
import shutil
import sys
import tempfile
import time

import pytest
from mpi4py import MPI

from hpengine.dist.topology import Mesh

WORLD = MPI.COMM_WORLD

# three documents (one file each): the validation split takes whole documents, here the short last one
TEXTS = (b"The quick brown fox jumps over the lazy dog. " * 40 + bytes(range(32, 127)) * 20,
         b"def f(x):\n    return x * 2\n" * 54, b"def f(x):\n    return x * 2\n" * 6)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Only rank 0 prints pytest's report; a failure on any rank still reaches stderr (below)."""
    if WORLD.Get_rank() > 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_collection_finish(session):
    """A module that draws its cases (a seeded sample) says how in SAMPLE_NOTE: rank 0 prints it before any test
    runs (under -q too), so that a failure, which aborts the job, can be drawn again."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:        # ranks above 0
        return
    notes = dict.fromkeys(getattr(getattr(item, "module", None), "SAMPLE_NOTE", None) for item in session.items)
    for note in filter(None, notes):
        reporter.write_line(note)


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and call.when == "call" and WORLD.Get_size() > 1:
        if call.excinfo.errisinstance(pytest.skip.Exception):
            return
        sys.stderr.write(f"\n[rank {WORLD.Get_rank()}] {item.nodeid} failed:\n{call.excinfo.getrepr(style='short')}\n"
                         "aborting the MPI job so no rank hangs\n")
        sys.stderr.flush()
        time.sleep(0.5)     # let the launcher forward the report: an abort can drop output still in flight
        WORLD.Abort(1)


@pytest.fixture(scope="session")
def world():
    return WORLD


@pytest.fixture
def root(world):
    """A checkpoint folder every rank sees, removed afterwards."""
    d = tempfile.mkdtemp(prefix="hpengine-ckpt-") if world.Get_rank() == 0 else None
    d = world.bcast(d, root=0)
    yield d
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def free_meshes(monkeypatch):
    """Free the communicators of every mesh a test built once it is over: MPI gives a process a few
    thousand, and the suite builds hundreds of engines. Cached results keep numbers, never communicators."""
    made, init = [], Mesh.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        made.append(self)
    monkeypatch.setattr(Mesh, "__init__", record)
    yield
    for mesh in made:
        mesh.free()


@pytest.fixture(scope="session")
def corpus():
    """A small HDF5 token file of three documents, written once by rank 0 into a folder every rank can see."""
    from hpengine.data import build_corpus
    path = None
    if WORLD.Get_rank() == 0:
        d = tempfile.mkdtemp(prefix="hpengine-mpi-")
        srcs = [os.path.join(d, f"text{i}.txt") for i in range(len(TEXTS))]
        for src, text in zip(srcs, TEXTS):
            with open(src, "wb") as f:
                f.write(text)
        path = build_corpus(srcs, os.path.join(d, "corpus.h5"))["path"]
    path = str(WORLD.bcast(path, root=0))
    yield path
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
