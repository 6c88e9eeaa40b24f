"""runtime.collectives: its choices, the one-line config error for NCCL over an explicit NumPy backend, and the
BackendError lines that make the run fall back to MPI (a NumPy backend; CuPy or its NCCL missing)."""
import importlib.util

import pytest

from hpengine.config.load import ConfigError, load_config
from hpengine.device.backend import Backend, BackendError, nccl_module


def test_collectives_defaults_to_mpi_and_names_its_choices():
    assert load_config(None).runtime.collectives == "mpi"
    assert load_config(None, ["runtime.collectives=nccl"]).runtime.collectives == "nccl"
    with pytest.raises(ConfigError) as info:
        load_config(None, ["runtime.collectives=gloo"])
    assert "runtime.collectives" in str(info.value) and '"nccl"' in str(info.value)


def test_nccl_over_an_explicit_numpy_backend_is_one_config_error():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["runtime.collectives=nccl", "runtime.backend=numpy"])
    msg = str(info.value)
    assert "\n" not in msg and "runtime.collectives = 'nccl'" in msg and "runtime.backend = 'numpy'" in msg
    assert load_config(None, ["runtime.collectives=nccl", "runtime.backend=auto"]).runtime.backend == "auto"


def test_a_numpy_backend_has_no_nccl_device():
    with pytest.raises(BackendError, match="the backend is numpy"):
        Backend("numpy", "float64").nccl_device()


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_without_cupy_nccl_module_says_how_to_install():
    with pytest.raises(BackendError, match="install hpengine\\[gpu\\]"):
        nccl_module()
