"""The unit tests run in one process that builds hundreds of engines, and MPI gives a process a few thousand
communicators: every mesh a test makes (not a module's fixture, made before it) is freed when the test ends."""
from __future__ import annotations

import pytest
from mpi4py import MPI

from hpengine.dist import topology


@pytest.fixture(autouse=True)
def free_meshes(monkeypatch):
    made = []
    init = topology.Mesh.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(topology.Mesh, "__init__", recording)
    yield made
    monkeypatch.undo()
    for mesh in reversed(made):
        if isinstance(mesh.world, MPI.Comm):     # not a test's stand-in world
            mesh.free()
