"""The array backends' CPU side: NumPy hands its own arrays to MPI, asking for CuPy without it (or a device) is
one clear error and "auto" falls back to NumPy, and the node-rank and CUDA-aware MPI queries answer."""
from __future__ import annotations

import numpy as np
import pytest

from hpengine.device import backend
from hpengine.dist import comm


def test_numpy_backend_hands_its_own_arrays_to_mpi():
    be = backend.make_backend("numpy", "float32")
    a = np.arange(4.0)
    assert be.stage_out(a) is a
    be.stage_in(a, a)
    assert comm.resolve_cuda_aware("auto", be) is False and comm.resolve_cuda_aware(True, be) is False
    assert backend.array_module(a) is np


def test_cupy_backend_without_cupy_is_a_clear_error():
    if backend.cupy_usable():
        pytest.skip("a CUDA device is usable here")
    with pytest.raises(backend.BackendError, match="install hpengine\\[gpu\\]"):
        backend.make_backend("cupy", "float32")
    assert backend.make_backend("auto", "float32").name == "numpy"


def test_local_rank_and_mpi_cuda_query():
    from mpi4py import MPI

    from hpengine.dist.topology import node_ranks
    assert node_ranks(MPI.COMM_SELF) == (0, 1)
    assert isinstance(comm.mpi_cuda_support(), bool)
