"""With HPENGINE_STANDIN=1 these GPU tests run on the CPU against the CuPy stand-in of tests/unit/emulated_cupy.py
(installed for the whole session, before the test modules ask whether a device is usable): a check of the
tests' own Python and of the engine's CuPy branches, not of a GPU; tests/unit/test_gpu_tests_on_standin.py runs
it. On a GPU machine, leave it unset. Also the fused kernels' tests' `entries` fixture."""
import os
import sys
from pathlib import Path

import pytest

if os.environ.get("HPENGINE_STANDIN") == "1":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import emulated_cupy  # noqa: E402

    _PATCH = pytest.MonkeyPatch()
    STANDIN = emulated_cupy.install(_PATCH)
    sys.modules["cupy"] = STANDIN

    # what only a device can show: its compiler's errors, and TF32 arithmetic (the stand-in keeps float32)
    DEVICE_ONLY = {"test_kernel_build_error_names_the_cu_line": "needs the real NVRTC compiler",
                   "test_tf32_engages_and_stays_accurate": "TF32 arithmetic needs the device's cuBLAS"}

    def pytest_collection_modifyitems(config, items):
        for item in items:
            why = DEVICE_ONLY.get(item.originalname)
            if why:
                item.add_marker(pytest.mark.skip(reason=f"on the CuPy stand-in: {why}"))


@pytest.fixture
def entries(monkeypatch):
    """The fused entries (hpengine/nn/fused.py) launched during a test, <op><tail> for the bits entries (_bf16,
    _bf16i, _bf16x, _bf16o): the comparisons must go through the kernels."""
    from hpengine.nn import fused
    seen, fn = set(), fused._fn
    monkeypatch.setattr(fused, "_fn", lambda entry, dtype, tail="": seen.add(entry + tail) or fn(entry, dtype, tail))
    return seen
